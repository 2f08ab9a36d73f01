"""Speculative decoding on the host: proposers (n-gram prompt lookup, a draft model) and
how much to speculate (the per-sequence AcceptanceTracker and the batch's CostGovernor). The
verification itself is jpaged.sample.rejection_sampler, run inside the worker's step.
"""
