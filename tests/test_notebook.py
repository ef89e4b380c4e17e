"""notebooks/plan_inspection.ipynb runs top to bottom without a cell error.

Executed with nbclient on the ``python3`` kernel. jupyter_client starts a kernel spec whose
command is ``python`` with the *current* interpreter (``sys.executable``), so the kernel sees
this venv's torch and autopar. It runs in a temporary working directory.
"""

from __future__ import annotations

import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "notebooks", "plan_inspection.ipynb")


def test_notebook_is_stored_with_its_outputs():
    """A reader of the repository sees what the notebook shows (it was run top to bottom,
    its cells in order); CI runs it again below."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.outputs for cell in code)
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))


def test_kernel_runs_this_interpreter():
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    cmd = KernelManager(kernel_name="python3").format_kernel_cmd()
    assert spec.argv[0] in ("python", "python3", sys.executable) or os.path.samefile(
        spec.argv[0], sys.executable
    )
    assert cmd[0] == sys.executable or os.path.samefile(cmd[0], sys.executable)


@pytest.mark.slow
def test_notebook_executes_without_errors(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=240,  # per cell
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError naming the cell and the traceback
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # networkx drawing, Gantt chart, what-if bars
    assert "# ladder: plan" in str(nb.cells[-1].outputs)  # explain's summary, shown as text
