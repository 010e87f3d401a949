"""Python processes for the tests that kill, signal or race real processes, without a fresh interpreter each.

`python -c CODE` pays about 1.7 CPU-seconds importing torch and pandas (through diffq_lab.core) before its first line;
the store's fault tests start some twenty such processes. Here a multiprocessing fork server imports diffq_lab.core once
and every process forks from it: still its own process (its own pid, signals, exit status, a SIGKILL that kills only
it), running CODE as `__main__` with `sys.argv[1:]` set, its stdout and stderr in files. What differs from a fresh
`python -c`: a KeyboardInterrupt that ends it exits 1 (multiprocessing prints its traceback), where python exits -2.
Stop the server when done (`stop()`): its CPU seconds are then counted with the test session's."""
import multiprocessing as mp, os, signal, subprocess, sys, tempfile, textwrap, time, warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_CTX = mp.get_context('forkserver')
_CTX.set_forkserver_preload(['__main__', 'diffq_lab.core'])  # __main__: pytest's own script, imported once, not per fork


def _main(code: str, argv: list[str], out: str, err: str, cwd: str):
    "In the forked process: stdout and stderr to files, SIGINT raising KeyboardInterrupt (even when the tests run with it ignored), then `code`."
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC); os.dup2(f, fd); os.close(f)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    warnings.simplefilter('ignore')  # as PYTHONWARNINGS=ignore: a library's warning is no part of what the tests read
    os.chdir(cwd)
    sys.argv = ['-c', *argv]
    exec(compile(code, '<string>', 'exec'), {'__name__': '__main__'})


class Forked:
    "A process forked from the server, running `code` (dedented) with `args`; a small part of subprocess.Popen's interface."
    def __init__(self, code: str, *args, cwd=ROOT):
        fd, self._out = tempfile.mkstemp(prefix='forked_', suffix='.out'); os.close(fd)
        fd, self._err = tempfile.mkstemp(prefix='forked_', suffix='.err'); os.close(fd)
        self.proc = _CTX.Process(target=_main, args=(textwrap.dedent(code), [str(a) for a in args], self._out, self._err, str(cwd)))
        self.proc.start()
        self.pid = self.proc.pid

    @property
    def returncode(self): return self.proc.exitcode  # -N: killed by signal N

    def kill(self): self.proc.kill()

    def send_signal(self, sig): os.kill(self.pid, sig)

    def wait(self, timeout=None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None: raise subprocess.TimeoutExpired(f'forked pid {self.pid}', timeout)
        return self.proc.exitcode

    def output(self) -> tuple[str, str]:
        "(stdout, stderr) written so far."
        return tuple(Path(p).read_text(errors='replace') for p in (self._out, self._err))

    def wait_for(self, line: str, timeout: float = 120):
        "Block until the process has printed `line` (a whole line of its stdout); AssertionError if it ends or times out first."
        end = time.monotonic() + timeout
        while line not in self.output()[0].splitlines():
            assert self.proc.exitcode is None and time.monotonic() < end, (self.proc.exitcode, self.output())
            time.sleep(0.01)

    def communicate(self, timeout=None) -> tuple[str, str]:
        "Wait for the end; (stdout, stderr), the files removed."
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(); self.proc.join(); raise
        out = self.output()
        for p in (self._out, self._err): os.unlink(p)
        return out


def stop():
    "Stop the fork server (it is started again on the next fork): it is reaped, so its CPU counts with the session's."
    from multiprocessing import forkserver
    stop_server = getattr(forkserver._forkserver, '_stop', None)  # private since 3.8; without it the server ends with pytest
    if stop_server is not None: stop_server()
