"""Host-side access to an untrusted directory: an agent's workspace, where every file is attacker-controlled.

Guarantees, for every function here:
  * no link is followed: every entry is `lstat`ed (`os.stat(..., follow_symlinks=False)`) before use, walks
    open each directory with O_NOFOLLOW relative to its parent's descriptor, and files are opened with
    O_NOFOLLOW | O_NONBLOCK and `fstat`ed again after the open (closes the lstat -> open race);
  * no hang and no unbounded read: symlinks, FIFOs, character/block devices and sockets are refused with
    `WorkspaceError("workspace file kernels/x.h is a symlink: refused")`; reads stop at a byte cap per file
    (FILE_CAP) and per tree (TOTAL_CAP), and walks stop at MAX_FILES regular files;
  * walks never descend into dot-dirs (.git, .ncu) or __pycache__, and list files in sorted order.
Not covered: the caller's own later use of a path it got from `walk` or `confine` (open it with
`read_bytes`/`read_text`/`write_text`, which re-check); a disk quota (`copy_tree` writes at most TOTAL_CAP).

Departures from the paper:
  1. The paper does not say how its harness reads agent-written files. Read naively, a link to /dev/zero
     exhausts the host's memory, a FIFO blocks it, and a link out shows the agent the harness's files.

Also the host-side validation of task and solution files the user names (`read_task`, `python_error`).

Smoke: python -m pytest tests/test_sandbox_files.py -q -k workspace
Full:  python -m pytest tests/test_sandbox_files.py tests/test_env_files.py -q
"""
from __future__ import annotations

import ast
import errno
import hashlib
import os
import stat

FILE_CAP = 4 << 20        # bytes read from one file
TOTAL_CAP = 64 << 20      # bytes read from one tree (snapshot, copy, digest)
MAX_FILES = 2000          # regular files in one tree
SKIP_DIRS = ("__pycache__",)   # never descended into, besides every dot-dir
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


class WorkspaceError(ValueError):
    """A workspace file the host refuses to touch; str(e) is one line naming the file and why."""


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refuse(label: str, mode: int):
    raise WorkspaceError(f"{label} is {_kind(mode)}: refused")


def _open(name: str, label: str, dir_fd: int | None = None, flags: int = _FILE_FLAGS, mode: int = 0o644) -> int:
    """fd of the regular file `name` (relative to dir_fd); refuses links and special files, never blocks.
    `label` names the file in errors ("workspace file kernels/x.h")."""
    try:
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:   # O_NOFOLLOW on a symlink
            raise WorkspaceError(f"{label} is a symlink: refused") from None
        if e.errno == errno.ENXIO:   # a socket, or a FIFO opened for writing without a reader
            raise WorkspaceError(f"{label} is a socket or FIFO: refused") from None
        raise WorkspaceError(f"{label} cannot be opened: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):   # swapped in between the caller's lstat and this open
        os.close(fd)
        _refuse(label, st.st_mode)
    return fd


def _read_fd(fd: int, label: str, cap: int) -> bytes:
    size = os.fstat(fd).st_size
    if size > cap:
        raise WorkspaceError(f"{label} is {size} bytes, more than the cap of {cap}")
    chunks, n = [], 0
    while True:
        b = os.read(fd, min(1 << 20, cap + 1 - n))
        if not b:
            return b"".join(chunks)
        chunks.append(b)
        n += len(b)
        if n > cap:   # it grew while being read
            raise WorkspaceError(f"{label} is more than the cap of {cap} bytes")


def _text(data: bytes) -> str:
    """Decoded like open(errors="replace") in text mode (universal newlines)."""
    return data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def read_bytes(path: str, cap: int = FILE_CAP, follow_links: bool = False) -> bytes:
    """Content of the regular file `path`, at most `cap` bytes. Its last component must not be a link,
    unless follow_links (for paths the host chose, e.g. a task file); the target must still be regular."""
    fd = _open(path, f"file {path}", flags=_FILE_FLAGS & ~os.O_NOFOLLOW if follow_links else _FILE_FLAGS)
    try:
        return _read_fd(fd, f"file {path}", cap)
    finally:
        os.close(fd)


def read_text(path: str, cap: int = FILE_CAP, follow_links: bool = False) -> str:
    return _text(read_bytes(path, cap, follow_links))


def write_text(path: str, text: str) -> None:
    """Write `path` (created or truncated); refuses a link or special file in its place."""
    fd = _open(path, f"file {path}", flags=os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        os.ftruncate(fd, 0)   # after the fstat check: O_TRUNC would act before it
        data = text.encode()
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def _entries(root: str, skip_dirs, max_files: int):
    """Yield (rel, dir_fd, name, stat) of every regular file under root, sorted, depth first.

    Directories are opened with O_NOFOLLOW relative to their parent's fd, so a directory swapped for a link
    after its lstat fails to open instead of leading the walk out of the tree. The root itself is the
    caller's path and may be a link."""
    count = 0

    def rec(fd: int, prefix: str):
        nonlocal count
        for name in sorted(os.listdir(fd)):
            rel = prefix + name
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if name.startswith(".") or name in skip_dirs:
                    continue
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    raise WorkspaceError(f"workspace dir {rel} cannot be opened: {e.strerror}") from None
                try:
                    yield from rec(sub, rel + "/")
                finally:
                    os.close(sub)
            elif stat.S_ISREG(st.st_mode):
                count += 1
                if count > max_files:
                    raise WorkspaceError(f"workspace has more than {max_files} files: refused")
                yield rel, fd, name, st
            else:
                _refuse(f"workspace file {rel}", st.st_mode)
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise WorkspaceError(f"workspace {root} cannot be opened: {e.strerror}") from None
    try:
        yield from rec(top, "")
    finally:
        os.close(top)


def walk(root: str, skip_dirs=SKIP_DIRS, max_files: int = MAX_FILES) -> list[str]:
    """Relative paths of every regular file under root; WorkspaceError on a link or special file."""
    return [rel for rel, _, _, _ in _entries(root, skip_dirs, max_files)]


def _files(root: str, skip_suffixes, skip_names, file_cap: int, total_cap: int, skip_large: bool = False):
    """Yield (rel, bytes, mode) of the regular files under root, capped per file and in total."""
    total = 0
    for rel, dfd, name, st in _entries(root, SKIP_DIRS, MAX_FILES):
        if rel in skip_names or name.endswith(tuple(skip_suffixes)) or (skip_large and st.st_size > file_cap):
            continue
        fd = _open(name, f"workspace file {rel}", dfd)
        try:
            data = _read_fd(fd, f"workspace file {rel}", file_cap)
        finally:
            os.close(fd)
        total += len(data)
        if total > total_cap:
            raise WorkspaceError(f"workspace holds more than {total_cap} bytes: refused")
        yield rel, data, st.st_mode


def snapshot(root: str, skip_suffixes=(".so", ".o", ".pyc", ".a"), skip_names=("model.py", "INSTRUCTIONS.md"),
             file_cap: int = 1_000_000, total_cap: int = TOTAL_CAP) -> dict[str, str]:
    """The agent's text files, relative path -> text (files larger than file_cap are left out, like build
    products); WorkspaceError on a link or special file."""
    return {rel: _text(data) for rel, data, _ in _files(root, skip_suffixes, skip_names, file_cap, total_cap,
                                                         skip_large=True)}


def copy_tree(src: str, dst: str, ignore_suffixes=(".so",), file_cap: int = FILE_CAP, total_cap: int = TOTAL_CAP,
              skip_names=()) -> list[str]:
    """Copy the regular files of src into dst (created; dirs made as needed), never through a link; returns
    the relative paths copied. Modes keep only the owner's execute bit."""
    out = []
    os.makedirs(dst, exist_ok=True)
    for rel, data, mode in _files(src, ignore_suffixes, skip_names, file_cap, total_cap):
        path = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o755 if mode & stat.S_IXUSR else 0o644)
        try:
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
        out.append(rel)
    return out


def tree_digest(root: str, skip_suffixes=(".so",), skip_names=(), file_cap: int = FILE_CAP,
                total_cap: int = TOTAL_CAP) -> str:
    """sha256 over every regular file under root (relative path, length, content), recursive."""
    h = hashlib.sha256()
    for rel, data, _ in _files(root, skip_suffixes, skip_names, file_cap, total_cap):
        h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def confine(root: str, rel: str) -> str:
    """Absolute path of `rel` inside root, for the caller to open. WorkspaceError (a ValueError) if it leaves
    root (.., absolute, a link out) or if its last component is a link or a special file (a directory or a
    missing file is fine: the caller reports or creates it)."""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise WorkspaceError("path must be a non-empty string")
    base = os.path.realpath(root)
    full = os.path.realpath(os.path.join(base, rel))
    if full != base and not full.startswith(base + os.sep):
        raise WorkspaceError(f"path {rel!r} is outside the workspace")
    try:
        st = os.stat(os.path.join(base, rel), follow_symlinks=False)
    except OSError:
        return full
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        _refuse(f"workspace file {rel}", st.st_mode)
    return full


# ----------------------------------------------------------------------------- task and solution files (host side)
# Checked in milliseconds before any sandbox work: text, parses, defines the names; errors name file and line.
class TaskError(Exception):
    """A malformed task; str(e) is one clear line (the sandbox raises it; it is never a candidate's verdict)."""


def read_file(path: str, what: str, err) -> str:
    """A file the user named: a regular file of UTF-8 text, read capped (links to one are fine)."""
    if os.path.isdir(path):
        raise err(f"{what} {path} is a directory" + (": give the task's .py file" if what == "task" else ""))
    try:
        data = read_bytes(path, follow_links=True)
    except WorkspaceError as e:
        raise err(f"{what} {e}") from None
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise err(f"{what} {path} is not UTF-8 text (byte {e.start})") from None


def _defines(tree: ast.Module) -> set[str]:
    """Top-level names a module binds (classes, functions, assignments, imports)."""
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return out


def python_error(source: str, name: str, needs: tuple[str, ...]) -> str | None:
    """Host-side check of a Python file in milliseconds: it parses and defines `needs` at top level.
    Returns one line naming the file (and line), or None."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return f"{name}: line {e.lineno}: SyntaxError: {e.msg}"
    missing = [n for n in needs if n not in _defines(tree)]
    return f"{name} defines no {', '.join(missing)}" if missing else None


def read_task(task: str | os.PathLike) -> str:
    """The task's source: a str is the source itself, a path (os.PathLike) the .py file to read; checked on the
    host (parses, defines Model, get_inputs and get_init_inputs). Raises TaskError with one line naming the file."""
    name, src = "task", task
    if not isinstance(task, str):
        name = os.fspath(task)
        if not os.path.lexists(name):
            raise TaskError(f"task file not found: {name}")
        src = read_file(name, "task", TaskError)
    err = python_error(src, name, ("Model", "get_inputs", "get_init_inputs"))
    if err:
        raise TaskError(err)
    return src
