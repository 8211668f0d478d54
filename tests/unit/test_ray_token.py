"""The Ray token exists, owner-only, wherever something starts or joins Ray."""

from __future__ import annotations

import stat
from concurrent.futures import ThreadPoolExecutor

from workers import ray_token


def _fresh_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)


def test_a_machine_that_never_ran_ray_gets_an_owner_only_token(monkeypatch, tmp_path):
    _fresh_home(monkeypatch, tmp_path)
    path = ray_token.ensure()
    assert path == tmp_path / ".ray" / "auth_token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_text()) == 64
    import os

    assert os.environ["RAY_AUTH_MODE"] == "token"


def test_an_existing_token_is_kept_and_made_owner_only(monkeypatch, tmp_path):
    _fresh_home(monkeypatch, tmp_path)
    path = tmp_path / ".ray" / "auth_token"
    path.parent.mkdir()
    path.write_text("abc123")
    path.chmod(0o644)  # as Ray's own generator leaves it
    assert ray_token.ensure() == path
    assert path.read_text() == "abc123"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_processes_starting_at_once_agree_on_one_token(monkeypatch, tmp_path):
    _fresh_home(monkeypatch, tmp_path)
    with ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(lambda _: ray_token.ensure(), range(8)))
    assert len(set(paths)) == 1 and len(paths[0].read_text()) == 64


def test_a_token_in_the_environment_or_auth_disabled_writes_nothing(monkeypatch, tmp_path):
    _fresh_home(monkeypatch, tmp_path)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert ray_token.ensure() is None
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert ray_token.ensure() is None
    assert not (tmp_path / ".ray").exists()
