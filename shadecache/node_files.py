"""The files shadecache keeps on a node belong to the user who runs it (docs/node_files.md).

/dev/shm and /tmp are shared by every user of the node, and the names shadecache uses there are
predictable, so another user can make a file under such a name first, or plant a link there.
Every file is therefore:

- made with O_CREAT|O_EXCL|O_NOFOLLOW and mode 0600 (a directory: 0700); a temporary name is
  random and made the same way, then renamed into place (never a name another user can guess);
- opened with O_NOFOLLOW and then checked on the descriptor (fstat: no race with the path): a
  regular file owned by this process's effective uid, with no permission for group or others.
  Anything else is refused with PermissionError naming its owner, before a byte of it is read,
  written or mapped;
- removed (gc, rm) only when this user owns it: lstat of the entry. In a sticky directory
  (/dev/shm, /tmp) nobody else can replace a file of ours between that look and the unlink.

Root passes every permission check of the kernel, so the owner check is what keeps a root job off
another user's files. The engine applies the same rules to the cache segment (csrc/common/own_file.h).
"""
import errno
import os
import pwd
import secrets
import stat
from typing import Optional, Tuple

_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC


def user(uid: int) -> str:
    """'uid 65534 (nobody)'; 'uid 1234' for a uid without an account."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _kind(st: os.stat_result) -> str:
    """'a regular file', 'a directory', 'a FIFO', ... for messages."""
    kinds = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(st.st_mode)), "an unknown kind of file")


def _foreign(what: str, path: str, st: os.stat_result, advice: str) -> PermissionError:
    kind = "" if stat.S_ISREG(st.st_mode) else f" ({_kind(st)})"
    return PermissionError(errno.EACCES,
                           f"{what} {path}{kind} belongs to {user(st.st_uid)}, not to this user "
                           f"({user(os.geteuid())}): refused, never read or written. {advice}".rstrip())


def _not_a_file(what: str, path: str, st: os.stat_result, outcome: str) -> PermissionError:
    """The refusal of this user's own entry that is not a regular file (a directory, a FIFO)."""
    return PermissionError(errno.EACCES, f"{what} {path} is {_kind(st)} of this user ({user(st.st_uid)}), "
                                         f"not a regular file (mode {stat.filemode(st.st_mode)}): "
                                         f"{outcome}; remove it")


def _a_link(what: str, path: str, st: os.stat_result, outcome: str, advice: str) -> PermissionError:
    """The refusal of a symbolic link (anyone's) where a file of ours belongs."""
    return PermissionError(errno.EACCES, f"{what} {path} is a symbolic link ({user(st.st_uid)}'s): "
                                         f"{outcome}. {advice}".rstrip())


def check(fd: int, path: str, what: str, tighten: bool = False,
          advice: str = "Another user made it: use another name, or have it removed.") -> os.stat_result:
    """The stat of `fd` (opened from `path`, a `what` for messages) when it is a regular file of
    this user closed to group and others; PermissionError otherwise, naming the owner. tighten: a
    file of this user that group or others may only read (an older shadecache made it 0644) is
    made 0600 instead."""
    st = os.fstat(fd)
    # The owner first: whatever another user planted (a file, a directory, a FIFO) is refused
    # as theirs, so the message says whom to ask.
    if st.st_uid != os.geteuid():
        raise _foreign(what, path, st, advice)
    if not stat.S_ISREG(st.st_mode):
        raise _not_a_file(what, path, st, "refused")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        if tighten and not mode & 0o022:
            os.fchmod(fd, mode & 0o700)
            return os.fstat(fd)
        raise PermissionError(errno.EACCES,
                              f"{what} {path} is open to group or others (mode {mode:04o}): refused, "
                              f"another user may have read or written it; remove it (it is yours)")
    return st


def _refusal(e: OSError, path: str, what: str, advice: str, dir_fd: Optional[int]) -> OSError:
    """The error for an open of `path` that failed with `e`: a link or another user's entry
    (whatever the kernel said: EACCES, ELOOP, EISDIR, ENXIO, ...) is named as such, with its
    owner (lstat, for the message only: the kernel refused already). A missing path stays
    FileNotFoundError; a failure on this user's own entry stays `e`."""
    if isinstance(e, FileNotFoundError):
        return e
    try:
        st = os.lstat(path, dir_fd=dir_fd)
    except OSError:
        return e
    if stat.S_ISLNK(st.st_mode):
        return _a_link(what, path, st, "refused, links are never followed", advice)
    if st.st_uid != os.geteuid():
        return _foreign(what, path, st, advice)
    return e


def open_file(path: str, flags: int, what: str, dir_fd: Optional[int] = None, create: bool = False,
              tighten: bool = False, advice: str = "Another user made it: use another name, or have it removed.") -> int:
    """A descriptor of `path` (relative to dir_fd when given) opened with `flags` plus O_NOFOLLOW,
    checked (see check()); made 0600 when `create` and missing. FileNotFoundError as os.open."""
    flags |= _OPEN | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600, dir_fd=dir_fd)
    except OSError as e:
        raise _refusal(e, path, what, advice, dir_fd) from None
    try:
        check(fd, path, what, tighten=tighten, advice=advice)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_file(path: str, flags: int, what: str, advice: str = "") -> int:
    """A new file at `path`, this user's, 0600 (O_CREAT|O_EXCL|O_NOFOLLOW). FileExistsError when
    the name is taken; it names the owner when that is another user."""
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL | _OPEN, 0o600)
    except FileExistsError as e:
        try:
            uid = os.lstat(path).st_uid
        except OSError:
            raise e from None
        if uid == os.geteuid():
            raise
        raise FileExistsError(errno.EEXIST, f"{what} {path} exists and belongs to {user(uid)}, not to "
                                            f"this user ({user(os.geteuid())}). {advice}".rstrip()) from None


def temporary(directory: str, prefix: str, dir_fd: Optional[int] = None) -> Tuple[int, str]:
    """(descriptor, path) of a new 0600 file named `prefix` + random + '.tmp' in `directory`
    (the path is relative to dir_fd when that is given), made with O_EXCL|O_NOFOLLOW."""
    for _ in range(100):
        name = f"{prefix}{secrets.token_hex(8)}.tmp"
        path = name if dir_fd is not None else os.path.join(directory, name)
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN, 0o600, dir_fd=dir_fd), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name {prefix}*.tmp in {directory}")


def replace(directory: str, name: str, data: bytes, what: str, dir_fd: Optional[int] = None,
            temp_prefix: Optional[str] = None, sync: bool = False) -> None:
    """Writes `data` to a temporary file (temporary()) and puts it in place as `name`: readers see
    the old file or the new one, whole. Only this user's own regular file at `name` is replaced;
    another user's entry, or anything but a regular file, is refused with PermissionError naming
    its owner. That holds for root too: the sticky /dev/shm lets root rename over anyone's file,
    so the kernel alone would not stop it. No temporary file is left behind."""
    fd, tmp = temporary(directory, temp_prefix or f"{name}.{os.getpid()}.", dir_fd)
    target = name if dir_fd is not None else os.path.join(directory, name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        if _put_in_place(tmp, target, what, dir_fd):
            tmp = None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except FileNotFoundError:
                pass


# link() errors that mean "no hard links on this file system" (vfat, some FUSE file systems).
_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK)


def _put_in_place(tmp: str, target: str, what: str, dir_fd: Optional[int]) -> bool:
    """Makes the file `tmp` the file at `target` (both relative to dir_fd when given). True when
    it was renamed (tmp is gone), False when it was linked (the caller removes tmp).

    A missing target is taken with link(), which fails when the name was made meanwhile, where
    rename() would replace whatever another user put there between our look and our move. An
    existing target is renamed over only when its lstat says it is this user's regular file: in a
    sticky directory (/dev/shm, /tmp) nobody else can replace a file of ours between that look and
    the rename, and in the SSD tier's own 0700 directory nobody else can write at all."""
    advice = "Another user made it first: it stays until they (or root) remove it."
    for _ in range(100):
        try:
            st = os.lstat(target, dir_fd=dir_fd)
        except FileNotFoundError:
            try:
                os.link(tmp, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
                return False
            except FileExistsError:
                continue   # made between the lstat and the link: look again at whose it is
            except OSError as e:
                if e.errno not in _NO_HARD_LINKS:
                    raise
            st = None      # no hard links here: rename, as on any file system
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise _a_link(what, target, st, "refused, never replaced", advice)
        if st is not None and st.st_uid != os.geteuid():
            raise _foreign(what, target, st, advice)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise _not_a_file(what, target, st, "refused, never replaced")
        try:
            os.rename(tmp, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except PermissionError as e:
            raise _refusal(e, target, what, advice, dir_fd) from None
        return True
    raise FileExistsError(errno.EEXIST, f"{what} {target} kept appearing and vanishing: not replaced")


def directory_path(path: str, what: str) -> str:
    """`path` with its empty and "." components dropped ("/scratch/tier/" and "/scratch/tier/."
    are "/scratch/tier"), so that its last component names the directory itself. The kernel
    follows a link at "tier" in "tier/" or "tier/." as it does at any component but the last,
    where O_NOFOLLOW would refuse it. A path ending in ".." (the parent of whatever its last
    component names, a link's target included) is refused with ValueError: name the directory."""
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"{what} must be a str path, got {type(path).__name__}")
    parts = [c for c in path.split("/") if c not in ("", ".")]
    if parts and parts[-1] == "..":
        raise ValueError(f"{what} {path!r} ends in '..': give the directory by its own name")
    lead = "/" if path.startswith("/") else ""
    return lead + "/".join(parts) if parts else (lead or ".")


def own_directory(path: str, what: str) -> int:
    """A descriptor (O_DIRECTORY, O_NOFOLLOW) of directory `path` (as directory_path() gives
    it), made 0700 when missing (its parents as os.makedirs makes them). Refused with
    PermissionError when it is a link, belongs to another user, or group or others may write
    it: whoever can write a directory can plant files and links in it. The directories above it
    are not checked."""
    path = directory_path(path, what)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    advice = "Use a directory of your own (shadecache makes it 0700 when it does not exist)."
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _OPEN)
    except OSError as e:
        raise _refusal(e, path, what, advice, None) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise _foreign(what, path, st, advice)
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o022:
            raise PermissionError(errno.EACCES, f"{what} {path} is writable by group or others (mode "
                                                f"{mode:04o}): refused, another user could plant files "
                                                f"or links in it. {advice}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def owned(path: str) -> bool:
    """Whether the entry `path` (not what a link names) exists and belongs to this user."""
    try:
        return os.lstat(path).st_uid == os.geteuid()
    except FileNotFoundError:
        return False
