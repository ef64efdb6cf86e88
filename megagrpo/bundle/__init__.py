"""Offline install bundles for a GPU node with a fixed torch (issue 28; docs/gpu.md, "Offline bundles").

What exists: reading a shared library's dynamic symbols with their version tags (`elf`), recording them
from wheels once into small JSON tables (`tables`), the target node's description (`target`), choosing the
newest candidate whose native libraries resolve against the target's libraries (`resolve`), and the
manifest (`manifest`). Trimming native libraries to the target's SM architectures (`trim`), building the
TE torch binding and packing the bundles do not exist yet.
"""
