#!/usr/bin/env bash
# The peer for data benchmarks and the TFRecord fixtures: tensorflow-cpu in its own venv
# (bench/.venv-tf). Never needed to build, test or run flotilla. Installs once.
set -euo pipefail
cd "$(dirname "$0")"
TF_VERSION=2.21.0
if ! compgen -G ".venv-tf/lib/python3*/site-packages/tensorflow_cpu-${TF_VERSION}.dist-info" >/dev/null; then
  [ -x .venv-tf/bin/python ] || python3 -m venv .venv-tf
  .venv-tf/bin/pip install --quiet "tensorflow-cpu==${TF_VERSION}"
fi
