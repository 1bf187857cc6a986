#!/bin/bash
# System packages for the launcher tests: a single-node Slurm cluster (slurmctld, slurmd,
# the client commands, munge) and iproute2 for the two-host network-namespace run; and Chromium
# for the browser test of primitives/debug_server.py (tests/test_debug_server.py: headless, it
# renders the debug server's page while a job hangs). Chromium is installed on its own, so that
# where it cannot be (Ubuntu's `chromium` is a snap, not a .deb) the others still are.
# Idempotent and never fatal: without them those tests skip and say why.
install() {  # install WHAT PACKAGE...: one apt-get run
    local what="$1"; shift
    echo "system packages: installing $*"
    if apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1; then
        echo "system packages: installed"
    else
        echo "system packages: install failed; the $what tests will skip"
    fi
}
need=()
for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge ip:iproute2 pgrep:procps unshare:util-linux; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair##*:}")
done
browser=()
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || browser=(chromium)
if [ ${#need[@]} -eq 0 ] && [ ${#browser[@]} -eq 0 ]; then echo "system packages: already installed"; exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system packages: missing ${need[*]} ${browser[*]} and cannot install (needs root and apt-get)"; exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get update -qq >/dev/null 2>&1; then
    echo "system packages: apt-get update failed; the Slurm / network-namespace / browser tests will skip"; exit 0
fi
[ ${#need[@]} -eq 0 ] || install "Slurm / network-namespace" "${need[@]}"
[ ${#browser[@]} -eq 0 ] || install "browser (Chromium)" "${browser[@]}"
exit 0
