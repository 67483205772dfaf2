"""Files and folders we write readable as the user's umask says, whatever wrote them."""

import os


def current_umask():
    """This process's umask, read without changing it (os.umask sets it: a thread writing a file meanwhile
    would get the wrong mode)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def follow_umask(path):
    """Give path (a file, or a folder and all under it) the mode a plain open() or mkdir() would have under the
    user's umask: safetensors writes its files, and mkdtemp its folder, readable by their owner only, and a
    model others open (ComfyUI as another user, a teammate) must be readable as the user's umask says."""
    umask = current_umask()

    def fix(name, base):
        os.chmod(name, (base & ~umask) | (os.stat(name).st_mode & 0o111 & ~umask))

    if os.path.isdir(path):
        fix(path, 0o777)
        for root, dirs, files in os.walk(path):
            for name in dirs:
                fix(os.path.join(root, name), 0o777)
            for name in files:
                if not os.path.islink(os.path.join(root, name)):
                    fix(os.path.join(root, name), 0o666)
    else:
        fix(path, 0o666)
