"""Closed to the network: every Ray port the suite opens asks for the token, a script joins only the
cluster it is given, the token made is private; and what was right before (safetensors only, no
remote code, no shell) stays so."""

import ast
import glob
import os
import tempfile
import time

from dreambooth import errors
from dreambooth.cluster import raycluster
from dreambooth.files import REPO_DIR

# One real method of each kind of Ray gRPC server: a server checks the token before it runs a method
# it has, and answers UNIMPLEMENTED (not UNAUTHENTICATED) for one it lacks.


def test_the_token_made_is_private_and_reused(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "ray" / "auth_token"))
    path = raycluster.ensure_ray_token()
    assert os.environ["RAY_AUTH_MODE"] == "token"  # on, for this process and those it starts
    token = open(path).read()
    assert len(token) == 64 and os.stat(path).st_mode & 0o777 == 0o600
    assert raycluster.ensure_ray_token() == path and open(path).read() == token  # reused, not replaced
    os.chmod(path, 0o644)  # as `ray get-auth-token --generate` writes it: readable by every local user
    raycluster.ensure_ray_token()
    assert os.stat(path).st_mode & 0o777 == 0o600 and open(path).read() == token
    assert token not in raycluster.ray_auth_note() and path in raycluster.ray_auth_note()
    monkeypatch.setenv("RAY_AUTH_TOKEN", "given")  # the token in the environment: no file made
    assert raycluster.ensure_ray_token() is None and raycluster.ray_auth_note().endswith("RAY_AUTH_TOKEN")
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # turned off knowingly: honoured, and said plainly
    os.remove(path)
    assert raycluster.ensure_ray_token() is None and not os.path.exists(path)
    assert "token authentication OFF" in raycluster.ray_auth_note()


def test_the_traceback_file_is_new_and_private(tmp_path, monkeypatch):
    """ray_failure's log goes to a fresh file in the temp folder: a link planted at a guessable name
    is never followed."""
    import ray.exceptions

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_text("keep")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in (f"dreambooth-error-{stamp}-{os.getpid()}.log", f"dreambooth-error-{stamp}-.log"):
        os.symlink(victim, tmp_path / name)
    err = errors.ray_failure(ray.exceptions.RayTaskError("f", "Traceback...\nValueError: boom", ValueError("boom")))
    log = err.args[0].split("(traceback in ")[1].rstrip(")")
    assert os.path.dirname(log) == str(tmp_path) and not os.path.islink(log)
    assert os.stat(log).st_mode & 0o777 == 0o600 and victim.read_text() == "keep"


def python_sources():
    skip = (os.path.join(REPO_DIR, ".venv"), os.path.join(REPO_DIR, "tests"))
    return [p for p in glob.glob(os.path.join(REPO_DIR, "**", "*.py"), recursive=True) if not p.startswith(skip)]


def calls(path):
    """(name, keywords, node) of every call in a source file ('torch.load', {'weights_only': ...})."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield ast.unparse(node.func), {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}, node


def test_no_remote_code_no_shell_no_pickle_without_weights_only():
    """What keeps a downloaded model or a user's string from running code, in every source file:
    no trust_remote_code, no shell=True or os.system, torch.load only with weights_only=True."""
    found = []
    for path in python_sources():
        for name, keywords, node in calls(path):
            where = f"{os.path.relpath(path, REPO_DIR)}:{node.lineno}"
            if keywords.get("trust_remote_code", "False") != "False":
                found.append(f"{where} trust_remote_code")
            if keywords.get("shell", "False") != "False" or name in ("os.system", "os.popen"):
                found.append(f"{where} shell")
            if name.endswith("torch.load") and keywords.get("weights_only") != "True":
                found.append(f"{where} torch.load without weights_only=True")
            if name in ("pickle.load", "pickle.loads", "eval", "exec"):
                found.append(f"{where} {name}")
    assert found == []
    # the guard sees what it guards: these are the calls it would name
    sample = "torch.load(p)\nsubprocess.run(c, shell=True)\nAutoModel.from_pretrained(d, trust_remote_code=True)\n"
    probe = os.path.join(tempfile.mkdtemp(), "probe.py")
    with open(probe, "w") as f:
        f.write(sample)
    names = [(n, k) for n, k, _ in calls(probe)]
    assert names == [("torch.load", {}), ("subprocess.run", {"shell": "True"}),
                     ("AutoModel.from_pretrained", {"trust_remote_code": "True"})]


def test_a_head_of_ours_never_gets_a_port_a_ray_node_takes_by_default():
    """The system hands out 52365, the port of every Ray node's dashboard agent, as a free one: a head started on it
    failed (once, a whole CI run: "... is trying to use a port number 52365 that is used by other components").
    free_port, which dreambooth_run.sh and the tests' heads take their port from, draws again."""
    from dreambooth.cluster import raycluster

    handed_out = iter([52365, 6379, 41234])
    assert raycluster.free_port(lambda: next(handed_out)) == 41234
    assert raycluster.free_port() not in raycluster.RAY_DEFAULT_PORTS
    assert "raycluster.free_port()" in open(os.path.join(REPO_DIR, "dreambooth_run.sh")).read()
