#!/usr/bin/env bash
# The README's Quick start as a reader runs it: a fresh clone of this commit, a venv inside it
# (`python3 -m venv .venv`, activated), then each line of README.md's Quick start block, read from
# README.md itself, in one shell. pip takes whichever torch the index gives, not CI's pin: on the
# CI machine (its pip configuration: a local index, torch capped at 2.14.1) that is 2.14.1+cu130,
# PyPI's CUDA build, which runs on the CPU; an index with no torch newer than 2.13.0+cpu would give
# the pinned build again, and this run would then add only the venv inside the checkout.
#
#   bash .ci/readme_path.sh           # clone, venv, the commands; exits with their status
#   bash .ci/readme_path.sh --print   # only print the commands it would run
set -euo pipefail
cd "$(dirname "$0")/.."

# The lines of the first ```bash block after the "## Quick start" heading.
commands=$(awk '/^## /{quick = ($0 == "## Quick start")} quick && /^```bash$/{block = 1; next}
                block && /^```/{exit} block && NF' README.md)
if [ -z "$commands" ]; then
    echo "readme path: README.md has no \`\`\`bash block under '## Quick start'" >&2
    exit 1
fi
if [ "${1:-}" = "--print" ]; then
    echo "$commands"
    exit 0
fi

work=$(mktemp -d /tmp/readme_path.XXXXXX)
trap 'rm -rf "$work"' EXIT
git clone -q . "$work/repo"
cd "$work/repo"
echo "readme path: a fresh clone of $(git rev-parse --short HEAD) in $work/repo, a venv in .venv"
script='set -e; python3 -m venv .venv; . .venv/bin/activate'
while IFS= read -r line; do
    script+="; echo; echo \"\$ \"$(printf '%q' "$line"); $line"
done <<<"$commands"
# Without the caller's PYTHONPATH or venv: what a reader's new shell has.
start=$SECONDS
status=0
env -u PYTHONPATH -u VIRTUAL_ENV bash -c "$script" || status=$?
torch=$(.venv/bin/python -c "import torch; print(torch.__version__)" 2>/dev/null || echo none)
echo "readme path: exit $status in $((SECONDS - start)) s, torch $torch, the venv in the checkout"
exit "$status"
