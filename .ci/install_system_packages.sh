#!/bin/bash
# System packages for the launcher tests: a single-node Slurm cluster (slurmctld, slurmd,
# the client commands, munge) and iproute2 for the two-host network-namespace run.
# Idempotent and never fatal: without them those tests skip and say why.
need=()
for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge ip:iproute2 pgrep:procps unshare:util-linux; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair##*:}")
done
if [ ${#need[@]} -eq 0 ]; then echo "system packages: already installed"; exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system packages: missing ${need[*]} and cannot install (needs root and apt-get)"; exit 0
fi
echo "system packages: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
if apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1; then
    echo "system packages: installed"
else
    echo "system packages: install failed; the Slurm / network-namespace tests will skip"
fi
exit 0
