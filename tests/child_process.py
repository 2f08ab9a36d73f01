"""Servers and workers that tests start die with the test process.

pytest-timeout's thread method and a crashed xdist worker end the test process without its
fixtures' teardown, which would leave a server it started running (and holding a core) for
the rest of the suite. setpriv (util-linux) sets the child's parent-death signal and then
execs the command, so the kernel kills the child when the test process dies; the child keeps
its pid, so signals sent to Popen.pid reach the command itself. (A test process that dies
before setpriv got that far sends no signal; every caller here first waits for its child.)
"""

from __future__ import annotations

import shutil


def dies_with_parent(cmd: list[str]) -> list[str]:
    """cmd run under `setpriv --pdeathsig KILL` (cmd as it is where setpriv is missing)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *cmd] if setpriv else list(cmd)
