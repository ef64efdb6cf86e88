#!/usr/bin/env bash
# The engine bundle's closure proof without a GPU (docs/gpu.md, "Offline bundles"): install a bundle into an
# empty folder inside a network namespace with only loopback, and run megagrpo's engine path from it on
# the CPU, with NODE_PYTHON an interpreter holding the node's torch (2.11.0+cu130) and its other packages.
#
#   tests/gpu/offline_check.sh NODE_PYTHON BUNDLE_DIR     (as root: unshare -n)
set -euo pipefail
py=${1:?usage: tests/gpu/offline_check.sh NODE_PYTHON BUNDLE_DIR}
bundles=$(cd "${2:?bundle folder}" && pwd)
site=$(mktemp -d /tmp/megagrpo-offline-XXXX)
exec unshare -n bash -c "
  set -euo pipefail
  ip link set lo up
  if $py -c 'import urllib.request as u; u.urlopen(\"https://pypi.org/simple/\", timeout=3)' 2>/dev/null; then
    echo 'the network is reachable: not an offline check' >&2; exit 1; fi
  $py -m megagrpo.bundle.install $bundles/engine.tar.xz --manifest $bundles/manifest.json --into $site/engine
  source $site/engine/megagrpo-bundle.env
  $py -m megagrpo.bundle.smoke imports sglang.srt.entrypoints.engine torch_memory_saver xgrammar megatron.core
  $py -m megagrpo.bundle.smoke engine
"
