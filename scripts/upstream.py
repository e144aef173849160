"""The pinned upstream snapshots the conformance tests run (slime, NeMo-RL, NeMo-Skills).

They are test-only and never copied into the project. A snapshot is found, for each name, at
`$SLIME_PATH` / `$NEMO_RL_PATH` / `$NEMO_SKILLS_PATH`, else under `$ROLLOUT_THIRD_PARTY`, else in
`../shared/third_party/<name>` beside the checkout; nowhere else. Each location holds the package
folder itself (`<location>/slime/`, `<location>/nemo_rl/`, `<location>/nemo_skills/`), as a clone of
the upstream repository at its pinned commit does.

    python -m scripts.upstream fetch [DEST]    # git-clone the three at their pinned commits (network)
    python -m scripts.upstream where           # where each is looked for, and whether it is there

`scripts/run_conformance.sh` installs the conformance extra, fetches what is missing and runs the
conformance tests with `ROLLOUT_REQUIRE_CONFORMANCE=1`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
THIRD_PARTY_ENV = "ROLLOUT_THIRD_PARTY"
SIBLING_THIRD_PARTY = REPO.parent / "shared" / "third_party"


class Upstream(NamedTuple):
    name: str  # the package folder, and the snapshot's folder under third_party/
    env_var: str  # a location of this one snapshot, overriding the folder of all three
    repository: str
    commit: str


PINNED = (
    Upstream("slime", "SLIME_PATH", "https://github.com/THUDM/slime", "624b824a898ab0ec1fcb4d373004c7f3852bf515"),
    Upstream("nemo_rl", "NEMO_RL_PATH", "https://github.com/NVIDIA-NeMo/RL", "7ea279abfbeb698b092856d0dab61e7cf39bc909"),
    Upstream(
        "nemo_skills", "NEMO_SKILLS_PATH", "https://github.com/NVIDIA-NeMo/Skills", "8b18f3992854bcb668095228a146e214c567b370"
    ),
)
BY_NAME = {u.name: u for u in PINNED}
FETCH_HINT = "scripts/run_conformance.sh fetches the pinned snapshots and runs the conformance tests (README, Conformance)"


def third_party_dir() -> Path:
    return Path(os.environ.get(THIRD_PARTY_ENV) or SIBLING_THIRD_PARTY)


def snapshot_path(name: str) -> Path:
    """Where the snapshot `name` is looked for (it may be missing: see `is_present`)."""
    upstream = BY_NAME[name]
    return Path(os.environ.get(upstream.env_var) or third_party_dir() / name).resolve()


def is_present(name: str) -> bool:
    return (snapshot_path(name) / name).is_dir()


def fetch(dest: Path) -> list[Path]:
    """Clone each missing snapshot into `dest/<name>` at its pinned commit; returns what it fetched."""
    fetched = []
    for upstream in PINNED:
        target = dest / upstream.name
        if (target / upstream.name).is_dir():
            continue
        # a shallow fetch of the one commit (GitHub serves any reachable commit by id)
        subprocess.run(["git", "init", "--quiet", str(target)], check=True)
        git = ["git", "-C", str(target)]
        subprocess.run([*git, "fetch", "--quiet", "--depth", "1", upstream.repository, upstream.commit], check=True)
        subprocess.run([*git, "checkout", "--quiet", "--detach", "FETCH_HEAD"], check=True)
        fetched.append(target)
    return fetched


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "where"
    if command == "fetch":
        dest = Path(argv[1]) if len(argv) > 1 else third_party_dir()
        for target in fetch(dest):
            print(f"fetched {target}")
        print(f"snapshots in {dest}: export {THIRD_PARTY_ENV}={dest} if that is not ../shared/third_party")
        return 0
    if command == "where":
        for upstream in PINNED:
            state = "present" if is_present(upstream.name) else "MISSING"
            print(f"{upstream.name:12} {state:8} {snapshot_path(upstream.name)}  ({upstream.repository} @ {upstream.commit[:12]})")
        return 0 if all(is_present(u.name) for u in PINNED) else 1
    print(f"usage: python -m scripts.upstream fetch [DEST] | where (got {command!r})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
