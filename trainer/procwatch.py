"""Whether a process has exited, for watchers that must not outlive the process that started them
(the ranks' supervisor watch in tasks/rank_main.py, the SGLang server wrapper). Standard library
only: the wrapper imports it from the SGLang environment's interpreter."""

import os
import shutil


def process_gone(pid: int) -> bool:
    """No such process, or a zombie its own parent has not reaped yet (kill(pid, 0) still succeeds
    on a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, under another user
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False  # no /proc (not Linux): kill(pid, 0) is all there is


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid`, read from /proc (none where there is no /proc)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                out.append(int(name))
    return out


def group_gone(pgid: int) -> bool:
    """No process left in the group but zombies not yet reaped."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return all(process_gone(pid) for pid in group_members(pgid))


def group_shared_memory(pgid: int, prefix: str) -> set[str]:
    """The files under /dev/shm whose names start with `prefix` that the processes of group `pgid`
    have mapped (read from /proc: none where there is none)."""
    found: set[str] = set()
    start = f"/dev/shm/{prefix}"
    for pid in group_members(pgid):
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.split(None, 5)[-1].strip()
                    if path.startswith(start) and not path.endswith("(deleted)"):
                        found.add(path)
        except OSError:  # gone meanwhile
            continue
    return found


SHARED_MEMORY_NOTE = "posttrain-shared-memory"  # in a server's temp folder: its /dev/shm files, one a line


def note_shared_memory(folder, prefix: str) -> bool:
    """Write into `folder` the /dev/shm files named `prefix`... that this process's group has mapped,
    so that whoever removes the folder (`remove_folder`) removes them too, even once the group is
    gone: a server that died on its own, or was killed by something else than its starter, leaves
    its shared memory behind. True once any is noted (the list is written whole, or not at all)."""
    found = group_shared_memory(os.getpgrp(), prefix)
    if found:
        part = os.path.join(folder, f".{SHARED_MEMORY_NOTE}.{os.getpid()}")
        try:
            with open(part, "w") as f:
                f.write("".join(f"{p}\n" for p in sorted(found)))
            os.replace(part, os.path.join(folder, SHARED_MEMORY_NOTE))
        except OSError:  # the folder was removed meanwhile (the server is being stopped)
            return False
    return bool(found)


def remove_folder(folder, shared_memory=()) -> None:
    """Remove `folder` (None: there is none) with the /dev/shm files its note lists and those in
    `shared_memory`. Only files directly in /dev/shm are removed, whatever the note says."""
    paths = set(shared_memory)
    if folder is not None:
        try:
            with open(os.path.join(folder, SHARED_MEMORY_NOTE)) as f:
                paths |= {line.strip() for line in f}
        except OSError:
            pass
    for path in paths:
        if os.path.dirname(path) == "/dev/shm" and os.path.basename(path) not in ("", ".", ".."):
            try:
                os.unlink(path)
            except OSError:
                pass
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def sweep_dead(folder, prefix: str) -> None:
    """Remove the files and folders in `folder` named `prefix` + a pid + "-..." whose process is gone:
    what a process killed before its own clean-up left (a rendezvous file, a server's temp folder).
    A link so named goes with the folder it points to, where that is a folder beside it.
    `prefix` names this machine, so a container sharing the folder, with processes this one cannot
    see, never has its live entries taken for dead ones."""
    from glob import escape
    from pathlib import Path

    for stale in Path(folder).glob(escape(prefix) + "*"):
        pid = stale.name[len(prefix):].partition("-")[0]
        if pid.isdigit() and process_gone(int(pid)):
            if stale.is_symlink():  # a note naming a folder another library made (`note_mp_temp_dir`)
                target = stale.parent / os.readlink(stale)
                if target.parent == stale.parent and target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target, ignore_errors=True)
                _unlink(stale)
            elif stale.is_dir():
                remove_folder(stale)  # with the shared memory it notes
            else:
                _unlink(stale)


def host_tag() -> str:
    """This machine's name, short and fixed in length, for the names of temp files swept by pid."""
    import hashlib
    import socket

    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


MP_TEMP_PREFIX = "posttrain-pymp-"


def note_mp_temp_dir() -> None:
    """Make this process's multiprocessing temp folder now (`multiprocessing.util.get_temp_dir`, a
    `pymp-...` folder in the temp folder, where sending a tensor to another process puts the socket
    that hands its file descriptor over), and beside it a link to it named after this machine and
    process. Python removes the folder when the process exits, but not after a SIGKILL: then the
    next process that calls this removes it and its link (`sweep_dead`), with what other dead
    processes left.

    Only a folder this call makes is linked. A process started by multiprocessing inherits its
    parent's folder (the path comes with the Process object), and a link under the child's pid would
    have the parent's live folder removed once the child is gone. Nor is a folder this process made
    before the call: whether it did is not known."""
    import tempfile
    from multiprocessing import process, util

    temp = tempfile.gettempdir()
    mine = f"{MP_TEMP_PREFIX}{host_tag()}-"
    sweep_dead(temp, mine)
    config = getattr(process.current_process(), "_config", None)  # where get_temp_dir keeps the path
    if not isinstance(config, dict) or config.get("tempdir") is not None:
        return  # inherited, made before, or noted already; or a Python that keeps it elsewhere
    folder = util.get_temp_dir()
    if os.path.dirname(folder) != temp:
        return  # made elsewhere (this process's TMPDIR changed meanwhile): not for this folder's sweep
    link = os.path.join(temp, f"{mine}{os.getpid()}-{os.path.basename(folder)}")
    try:
        os.symlink(os.path.basename(folder), link)
    except OSError:
        return  # unlinked, the folder is only left after a SIGKILL, as without this
    # gone with the folder at a clean exit (multiprocessing removes it with this same priority)
    util.Finalize(None, _unlink, args=(link,), exitpriority=-100)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
