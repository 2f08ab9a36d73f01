"""What users call: the offline LLM class, the `jpaged` command's engine commands, batch
files, and the engine arguments (LLM keyword arguments and CLI flags, both derived from the
configs in jpaged/config.py). Nothing below imports this package.
"""
