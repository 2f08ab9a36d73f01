"""The host side of the engine: requests, queues and pages.

Owns every piece of changing host state: LLMEngine the requests and the step loop
(plan -> dispatch -> fetch -> commit -> outputs), Scheduler the waiting and running queues and
each sequence's page-table row, PageAllocator the free list, reference counts and the
prefix-cache index, OutputProcessor each sequence's text and stop strings. Beam search and
the data-parallel engine are built on LLMEngine. It drives the device only through
jpaged.worker (the StepPlan it makes is the worker's input) and never imports entrypoints.
"""
