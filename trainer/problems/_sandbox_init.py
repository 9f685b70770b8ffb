"""The sandbox's launcher: run by `python -I -S` (the standard library only, nothing of posttrain
imported), it puts one execution into namespaces of its own and becomes nothing but its watcher.

argv[1] is a JSON spec from trainer.problems.sandbox. As root the child gets new mount, network,
PID, IPC and UTS namespaces, a read-only root of its own (the system's libraries, the interpreter's
standard library, four device nodes, nothing else), a size-limited empty working folder, a user ID
of its own that owns nothing, no capabilities, no setuid, resource limits, and dies with this
process. Without root it tries the same inside a user namespace (the program then runs as that
namespace's root, which owns nothing outside it); where that is refused too it runs with the limits
and an empty folder only. The launcher writes which of the three it got on the spec's mode_fd, and at the end the CPU
seconds its child used.""" 

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {src} on {dst}")


KEEP = 1 | 2 | 4 | 8 | 1024 | 2048  # rdonly nosuid nodev noexec noatime nodiratime: statvfs and mount agree


def bind_ro(src: str, root: str, flags: int = MS_NODEV) -> None:
    """src at the same path under root, read-only, no setuid (a symlink stays a symlink); the
    source's own restrictions are kept (a user namespace may not lift them)."""
    dst = root + src
    if os.path.islink(src):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.symlink(os.readlink(src), dst)
        return
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "w").close()
    mount(src, dst, None, MS_BIND | MS_REC)
    kept = os.statvfs(src).f_flag & KEEP
    mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | flags | kept)


def build_root(spec: dict, uid: int, gid: int) -> None:
    """Inside a fresh mount namespace: a tmpfs root holding only what the interpreter needs."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host's mounts
    root = "/tmp/.posttrain-sandbox-root"  # a path in this namespace's own tmpfs, below
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    os.makedirs(root)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for d in spec["system"]:
        if os.path.lexists(d):
            bind_ro(d, root)
    bind_ro(spec["prefix"], root)
    for hidden in spec["hide"]:  # the interpreter's own site-packages: nothing installed is importable
        if os.path.isdir(root + hidden):
            mount("tmpfs", root + hidden, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=0555")
    os.makedirs(root + "/dev")
    for dev in ("null", "zero", "random", "urandom"):
        bind_ro(f"/dev/{dev}", root, flags=0)
    box = root + "/box"
    os.makedirs(box)
    mount("tmpfs", box, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={spec['disk_kb']}k,nr_inodes={spec['inodes']},mode=0700,uid={uid},gid={gid}")
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(root)
    os.chdir("/box")


def limit(spec: dict) -> None:
    for name, value in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))


def orphaned(alive: int) -> bool:
    """Whether the watcher has gone (the end of its pipe that it holds is closed)."""
    import select

    return bool(select.select([alive], [], [], 0)[0])


def child(spec: dict, mode: str, uid: int, alive: int) -> None:
    """The namespace's first process: isolate, drop everything, become the program's interpreter."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if orphaned(alive):  # the watcher died before the line above: PDEATHSIG would never come
        os._exit(137)
    gid = uid
    if mode in ("root", "userns"):
        build_root(spec, uid, gid)
    else:
        os.chdir(spec["folder"])
    limit(spec)
    os.setsid()  # its own session: signalling "its group" reaches only the sandbox
    if mode == "root":
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)  # a user that owns nothing; every capability goes with root
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # again: changing the user clears it
    if orphaned(alive):
        os._exit(137)
    os.close(alive)
    os.execve(spec["python"], [spec["python"], "-I", "-S", "-B", "-c", spec["harness"]],
              {"PATH": "/usr/bin:/bin", "HOME": "/box" if mode != "none" else spec["folder"],
               "TMPDIR": "/box" if mode != "none" else spec["folder"], "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"})


def enter(mode: str) -> str:
    """Unshare what this mode allows; the mode actually got."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if mode == "root" and libc.unshare(flags) == 0:
        return "root"
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(flags | CLONE_NEWUSER) != 0:
        return "none"
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {gid} 1")
    return "userns"


def main() -> None:
    spec = json.loads(sys.argv[1])
    uid = 100000 + os.getpid()  # live launchers have distinct PIDs, so their sandboxes distinct users
    mode = enter("root" if os.geteuid() == 0 else "userns")
    os.write(spec["mode_fd"], (mode + "\n").encode())
    alive, hold = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(hold)
        os.close(spec["mode_fd"])
        try:
            child(spec, mode, uid if mode == "root" else 0, alive)
        except BaseException as e:  # noqa: BLE001 - the setup failed: say why, never run the program
            os.write(2, f"posttrain sandbox: setup failed: {type(e).__name__}: {e}\n".encode())
        os._exit(96)
    os.close(alive)
    for fd in (0, 1, 2, spec["result_fd"]):
        os.close(fd)
    signal.signal(signal.SIGTERM, lambda *_: (os.kill(pid, signal.SIGKILL), os._exit(137)))
    _, status, usage = os.wait4(pid, 0)
    # the CPU its first process used: a namespace's first process ignores SIGXCPU, so the CPU limit
    # ends it with the hard limit's SIGKILL, and this tells that apart from any other kill
    os.write(spec["mode_fd"], f"cpu {usage.ru_utime + usage.ru_stime:.3f}\n".encode())
    os._exit(os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
