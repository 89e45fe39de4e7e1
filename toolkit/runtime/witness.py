"""One per machine under mpiexec or srun: names the rank that died first, with its exit code or signal.

Started by `peers.exchange` (run by path, standard library only), in its own session and writing to the
ranks' stderr. It holds a pidfd of every rank of its machine and sleeps until one ends. Then:

- exit code 0, or the rank left a mark (`peers.mark`: it raised, failed because of a peer, or finished its
  script): silent, the rank spoke for itself (and the survivors' errors name a rank that ended early);
- otherwise (a signal, `os._exit(3)`, a crash in native code), if it is the first rank of this machine to
  end and no rank had raised: it prints which rank, which pid, and how. Whatever ends after the first end
  is the job being ended (the launcher's cleanup, a survivor's abort), not a cause.

It exits when every rank of its machine has ended (the launcher waits for it: it holds their stderr).
Why not the survivors: mpiexec kills every rank the moment one dies of a signal, before a survivor's
collective has even failed. The witness is not a rank, and its own session keeps it out of that cleanup.
"""

from __future__ import annotations

import os
import select
import sys

import exits  # this folder is on sys.path: the witness is run by path


def main(marks: str, host: str, pairs: list[str]) -> None:
    ranks = {int(r): int(pid) for r, pid in (p.split(":") for p in pairs)}
    fds = {fd: r for r, pid in ranks.items() if (fd := exits.watch(pid)) is not None}
    open(os.path.join(marks, "watching"), "w").close()  # the rank that started it waits for this
    first = True
    while fds:
        ready, _, _ = select.select(list(fds), [], [])
        spoke = os.listdir(marks)  # "raised-<rank>", "consequence-<rank>", "ended-<rank>": written before ending
        ended = {}
        for fd in ready:
            rank = fds.pop(fd)
            ended[rank] = exits.status(fd, ranks[rank])
            os.close(fd)
        silent = [r for r, code in ended.items() if code != 0 and not any(n.endswith(f"-{r}") for n in spoke)]
        if first and silent and not any(n.startswith("raised-") for n in spoke):
            try:
                os.write(2, _story(silent, ended, ranks, host).encode())
            except OSError:  # the launcher is gone already
                pass
        first = False  # only the first end on this machine can be a silent cause: after it, the launcher cleans up
    for name in os.listdir(marks):
        os.remove(os.path.join(marks, name))
    os.rmdir(marks)


def _story(silent: list[int], ended: dict, ranks: dict, host: str) -> str:
    """A line per rank that ended without a word (seen ending together: usually one), then what that means."""
    lines = []
    for rank in sorted(silent):
        code = ended[rank]
        how = exits.story(code) if code is not None else "died without raising (how, this kernel cannot tell)"
        lines.append(f"[rank{rank}]: toolkit: rank {rank} (pid {ranks[rank]} on {host}) {how}.")
    first = (
        "It is"
        if len(silent) == 1
        else (f"Ranks {', '.join(map(str, sorted(silent)))} were seen ending together: the first of them is")
    )
    return "\n".join(lines) + (
        f" {first} the cause; what the other ranks report after this (a lost peer, the "
        "launcher ending the job) are consequences of it.\n"
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
