"""CuTeDSL kernel sources and their build specs (build time only: the runtime never imports this package).

Layout:
  <family>/__init__.py  one op: its frozen Config, configs(), can_implement(), the param ABI, build_spec() and
                        build_set() (which build set each variant is in); never imports cutlass
  <family>/build.py     its build entry, compile(config, arch): the kernel class a config picks, compiled
  <family>/kernel.py    the kernel classes (kernel.py the base, mma.sync where a family has both MMAs; wgmma.py,
                        pingpong.py, ... the subclasses that override what differs)
  catalogue.py          every family, and the variants of the build sets asked for
  spec.py               BuildSpec, the build sets (default, hopper_sync_check, opt_in), the shared refusals
  compile.py            the compile machinery: fake arguments of the declared ABI, cute.compile, ptxas's warnings
  constants.py, barriers.py
                        numbers and dtype names every kernel shares; named barrier ids per kernel
  tiles.py, wgmma.py, kl_rows.py, work_items.py, atomics.py, packed.py
                        device pieces shared by the families: shared-memory tiles, gathers and MMA views; the
                        wgmma issue loop; the proxy KL's row math; work-item decode; reductions; packed stores
  tiles_check.py        a host-side check of the row copies' thread layouts (tests/test_build_sparse.py)
"""
