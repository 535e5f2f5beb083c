#!/usr/bin/env bash
# The same bootstrap on every worker (launch setup): bash -s -- TARBALL BUCKET MOUNT [KIND]
#   TARBALL  gs:// URL of `git archive` of the commit to run
#   BUCKET   bucket name (no gs://) mounted read-write at MOUNT with gcsfuse: the run's shared
#            directory (run dir, serving address files, the weights store, shipped logs)
#   KIND     "tpu" (default: a TPU VM, jax[tpu] added) or "cpu" (a retrieval host)
# Only what a role needs: requirements-runtime.txt (no torch, pytest, ruff or notebooks; those
# are requirements.txt's test and tool pins). Idempotent: rerunning replaces the code and
# reinstalls nothing that is already pinned.
set -euo pipefail
TARBALL=$1 BUCKET=$2 MOUNT=$3 KIND=${4:-tpu}
CODE=~/asearcher_jax VENV=~/asearcher_venv
# Python 3.11 (requires-python) and gcsfuse (https://cloud.google.com/storage/docs/gcsfuse-install)
if ! command -v python3.11 >/dev/null || ! command -v gcsfuse >/dev/null; then
  echo "deb https://packages.cloud.google.com/apt gcsfuse-$(lsb_release -c -s) main" \
    | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null
  curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg \
    | sudo gpg --dearmor --yes -o /etc/apt/trusted.gpg.d/gcsfuse.gpg
  sudo apt-get update -qq
  sudo apt-get install -y -qq python3.11 python3.11-venv gcsfuse
fi
rm -rf "$CODE" && mkdir -p "$CODE"
gcloud storage cat "$TARBALL" | tar -xz -C "$CODE"
[ -d "$VENV" ] || python3.11 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q -r "$CODE/requirements-runtime.txt"
"$VENV/bin/pip" install -q --no-deps -r "$CODE/requirements-nodeps.txt"
if [ "$KIND" = tpu ]; then
  JAX_VERSION=$(sed -n 's/^jax==//p' "$CODE/requirements-runtime.txt")
  "$VENV/bin/pip" install -q "jax[tpu]==$JAX_VERSION"
fi
"$VENV/bin/pip" install -q --no-deps -e "$CODE"
sudo mkdir -p "$MOUNT" && sudo chown "$USER" "$MOUNT"
mountpoint -q "$MOUNT" || gcsfuse --implicit-dirs "$BUCKET" "$MOUNT"
"$VENV/bin/python" -c "import jax; print('devices', jax.device_count(), jax.devices()[0].platform)"
