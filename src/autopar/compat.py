"""The one door to PyTorch's private APIs: the torch releases this project has tested, and
each private name it uses, found here and nowhere else.

Why: autopar reads and calls parts of Dynamo, AOTAutograd and Inductor that are not public,
and some of its fast paths (*bypasses*) copy what PyTorch does per call to skip a wrapper:

* ``capture.dynamo_call``: Dynamo's cached code, called after Dynamo's own guards;
* ``capture.direct_autograd``: AOTAutograd's runtime wrapper replaced where it has nothing to
  do (it reads AOTAutograd's ``ViewAndMutationMeta``);
* ``runtime.native_direct`` and the native batch split (``split.cpp``): compiled programs
  called from C++ (the second calls Inductor's C++-wrapper entry by its symbol).

A feature check ("this torch has the names") would turn them on for a release whose
behaviour behind the names changed, and a wrong guess there corrupts results silently. So
the bypasses run only on a release listed in :data:`TESTED_RELEASES` and only while the
snapshot of what they rely on matches (``tests/test_compat.py`` pins the snapshot); on any
other release they are off, with one info line on the ``"autopar"`` logger, and the public
paths run. ``AUTOPAR_BYPASSES=0`` turns them off on a tested release too.

Example::

    >>> from autopar import compat
    >>> compat.release() in compat.TESTED_RELEASES or not compat.bypasses_on()
    True
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch

log = logging.getLogger("autopar")

#: The torch releases the whole test suite ran on (``make test``), without a build tag.
TESTED_RELEASES = ("2.13.0",)
#: ``AUTOPAR_BYPASSES=0``: the public paths only, on any release.
ENV = "AUTOPAR_BYPASSES"
#: The fields of AOTAutograd's ``ViewAndMutationMeta`` that ``capture.direct_autograd``
#: was written against (torch 2.13): another set means AOTAutograd's runtime wrapper may do
#: work that the direct path does not.
AOT_META_FIELDS = frozenset({
    "act_input_indices", "bw_donated_idxs", "compile_id_str", "deterministic",
    "grad_enabled_mutation", "graphsafe_rng_device", "graphsafe_rng_state_index",
    "indices_of_inputs_that_requires_grad_with_mutations_in_bw", "input_info",
    "keep_input_mutations", "mutated_inp_stream_indices", "num_backward_tokens",
    "num_graphsafe_rng_states", "num_intermediate_bases", "num_opaque_objects_saved_for_bw",
    "num_symints_saved_for_bw", "num_tensors_saved_with_no_vc_check", "output_info",
    "static_input_indices", "subclass_fw_graph_out_meta", "subclass_inp_meta",
    "subclass_tangent_meta", "tangent_source_stack_traces", "tokens", "traced_tangent_metas",
    "traced_tangents", "traced_tangents_descs",
})  # fmt: skip


def release(version: str | None = None) -> str:
    """The torch release, without its build tag: ``"2.13.0"`` for ``"2.13.0+cpu"``."""
    return str(torch.__version__ if version is None else version).split("+")[0]


def tested() -> bool:
    """Whether this torch is a release the project has tested."""
    return release() in TESTED_RELEASES


def bypasses_off_reason() -> str | None:
    """Why the bypasses are off in this process (None: they are on)."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return f"switched off (${ENV}=0)"
    if not tested():
        return (f"torch {release()} is not a tested release "
                f"({', '.join(TESTED_RELEASES)}): the public paths run")  # fmt: skip
    why = _snapshot_problem()
    if why is not None:
        return f"this torch differs from the tested one ({why}): the public paths run"
    return None


def bypasses_on() -> bool:
    """Whether the fast paths that copy PyTorch's per-call work may run (module docstring).
    The first time they may not, one info line says why."""
    why = bypasses_off_reason()
    if why is not None:
        _say_once(why)
    return why is None


@functools.cache
def _say_once(why: str) -> None:
    log.info("autopar: the fast paths around Dynamo and AOTAutograd are off: %s", why)


@functools.cache
def _snapshot_problem() -> str | None:
    """What of the bypasses' snapshot this torch does not match (None: all of it)."""
    try:
        from torch._functorch._aot_autograd.schemas import ViewAndMutationMeta
    except ImportError:
        return "no ViewAndMutationMeta"
    fields = {f.name for f in dataclasses.fields(ViewAndMutationMeta)}
    if fields != AOT_META_FIELDS:
        return f"ViewAndMutationMeta fields {sorted(fields ^ AOT_META_FIELDS)} changed"
    if dynamo_cache_entries() is None:
        return "no Dynamo cache-entry API"
    return None


# -- the private names ----------------------------------------------------------------------
def dynamo_cache_entries():
    """Dynamo's cache entries of a code object (``_debug_get_cache_entry_list``), or None."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None
    return _debug_get_cache_entry_list
