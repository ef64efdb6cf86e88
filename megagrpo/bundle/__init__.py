"""Offline install bundles for a GPU node with a fixed torch (issue 28; docs/gpu.md, "Offline bundles").

Version selection by symbol tables (`elf`, `tables`, `target`, `resolve`), the import closure of
megagrpo's paths (`closure`), trimming native libraries to the target's SMs (`trim`, `wheels`), building
TE's torch binding (`binding`), packing (`pack`, `build`), the manifest (`manifest`), and on the node the
install and smoke check (`install`, `smoke`: standard library first, so they run before the bundle is in
place).
"""
