#!/usr/bin/env bash
# Make sure a real MPI is here for tests/system/test_mpi.py: Debian's MPICH (`mpicc.mpich`
# and its library), whose start-up talks to srun's PMI server (`srun --mpi=pmi2`).
#
# Idempotent: exits 0 at once when mpicc.mpich compiles; as root with apt-get it installs
# mpich and libmpich-dev; otherwise it says what to install and exits 1. Not being root is
# not an error here: the test is skipped outside CI when the compiler is missing.
set -euo pipefail

if command -v mpicc.mpich >/dev/null 2>&1; then
    echo "ensure-mpi: MPICH is available ($(command -v mpicc.mpich))"
    exit 0
fi
packages="mpich libmpich-dev"
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    cat >&2 <<MSG
ensure-mpi: MPICH (mpicc.mpich) is missing; the MPI test is skipped outside CI. Install it:
  Debian/Ubuntu:  apt-get install -y $packages
MSG
    [[ -n "${CI:-}" ]] && exit 1
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
echo "ensure-mpi: installing $packages with apt-get"
apt-get update
# shellcheck disable=SC2086  # word splitting of the package list is intended
apt-get install -y --no-install-recommends $packages
command -v mpicc.mpich >/dev/null 2>&1 || { echo "ensure-mpi: installed, but no mpicc.mpich" >&2; exit 1; }
echo "ensure-mpi: MPICH is available"
