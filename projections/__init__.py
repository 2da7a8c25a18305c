"""Projections: the DuckDB view of the streams (``llmgw project``), and nothing else.

``runner.Projector`` reads every stream, folds it by the fleet's one rule
(``llmgw.fleet.fold_batch``) and hands the rows to ``writer`` (a child process that owns
the DuckDB file); ``store.Store`` is the schema and the one transaction that commits the
rows with the stream positions; ``export`` writes the analysts' copy and Parquet.
"""

from typing import TYPE_CHECKING

from llmgw import lazy_face

if TYPE_CHECKING:
    from llmgw.projections.export import analysts_copy_of, existing_copy_of, export_parquet
    from llmgw.projections.runner import Projector
    from llmgw.projections.store import DatabaseHeldError, Store, usage_rows

_FACE = {
    "analysts_copy_of": "llmgw.projections.export",
    "existing_copy_of": "llmgw.projections.export",
    "export_parquet": "llmgw.projections.export",
    "Projector": "llmgw.projections.runner",
    "DatabaseHeldError": "llmgw.projections.store",
    "Store": "llmgw.projections.store",
    "usage_rows": "llmgw.projections.store",
}
__all__ = ["DatabaseHeldError", "Projector", "Store", "analysts_copy_of", "existing_copy_of", "export_parquet",
           "usage_rows"]
__getattr__ = lazy_face(__name__, _FACE)
