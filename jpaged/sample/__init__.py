"""Choosing tokens on the device: SamplingParams (what a request asks for), the jitted
sampler (temperature, top-k/p, min-p, penalties, logprobs), logits processors (logit bias,
grammar masks) and the rejection sampler that verifies speculative proposals. Pure functions
over arrays, and parameters validated on construction; no engine state.
"""
