"""The device side: the StepPlan a scheduler hands over, its packing into bucketed
StepInputs, the jitted step programs (compiled per key and counted), and ModelRunner, which
owns the device state (page pool, device page table, previous tokens) and the host swap
space. Also model loading, multi-host broadcast, the compilation and executable caches and the
mapping-count guard. Never imports the scheduler or anything else in jpaged.core.
"""
