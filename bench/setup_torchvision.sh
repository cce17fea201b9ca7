#!/usr/bin/env bash
# torchvision for the benchmarks of models nobody here wrote (bench/peers.sh MODELS=tv-...): the
# version made for the project's torch 2.11, without its dependencies (torch, numpy and Pillow
# are the project venv's), into bench/.torchvision, which the benchmarks put on PYTHONPATH: the
# project venv is not changed. Never needed to build, test or run flotilla. Installs once.
set -euo pipefail
cd "$(dirname "$0")"
TORCHVISION_VERSION=0.26.0
if ! compgen -G ".torchvision/torchvision-${TORCHVISION_VERSION}.dist-info" >/dev/null; then
  ../.venv/bin/python -m pip install --quiet --no-deps --target .torchvision \
    "torchvision==${TORCHVISION_VERSION}"
fi
