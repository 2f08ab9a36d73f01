import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent

# A parent that starts a sleeping child (under dies_with_parent or not), prints the child's
# pid once it runs the command, and exits at once, running no cleanup.
PARENT = """
import os, subprocess, sys
sys.path.insert(0, {here!r})
from child_process import dies_with_parent
cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # the pipes close now
child = subprocess.Popen(dies_with_parent(cmd) if {wrap} else cmd, **quiet)
# setpriv sets the signal before it execs the command: wait until the child runs the
# command, its argv[0] no longer setpriv (a parent that dies before that sends no signal).
cmdline = "/proc/%d/cmdline" % child.pid
while open(cmdline, "rb").read().split(b"\\0")[0] != sys.executable.encode():
    pass
print(child.pid, flush=True)
os._exit(0)
"""


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie, not yet reaped, counts as dead)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _orphan(wrap: bool) -> int:
    script = PARENT.format(here=str(HERE), wrap=wrap)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def _alive_after(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _alive(pid)


def test_a_child_dies_with_the_process_that_started_it():
    assert not _alive_after(_orphan(wrap=True), 10.0)


def test_without_it_the_child_outlives_its_parent():
    # The control: the same parent without dies_with_parent leaves its child running.
    pid = _orphan(wrap=False)
    try:
        assert _alive_after(pid, 1.0)
    finally:
        subprocess.run(["kill", "-9", str(pid)], check=False)
