"""RichModelSummary: the model summary drawn as a table with rich (Lightning's ``RichModelSummary``)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from phalanx.callbacks.model_summary import SUMMARY_HEADER, ModelSummary, summary_rows, summary_totals

if TYPE_CHECKING:
    from phalanx.module import TrainingModule


def require_rich(name: str) -> None:
    """Raise ModuleNotFoundError, naming the extra to install, when rich is not installed."""
    if importlib.util.find_spec("rich") is None:
        raise ModuleNotFoundError(
            f"{name} needs the rich package, which is not installed: pip install 'phalanx[rich]' (or pip install rich)."
        )


class RichModelSummary(ModelSummary):
    """The summary of :class:`~phalanx.callbacks.ModelSummary` (layers down to ``max_depth``, parameter counts,
    size), printed on rank 0 at fit start as a rich table. Needs ``rich`` (``pip install 'phalanx[rich]'``);
    ``Trainer(callbacks=[RichProgressBar()])`` uses it as the default summary.

    Args:
        max_depth: How deep to list submodules: 1 the direct children, -1 all of them, 0 disables the summary.
        header_style: The rich style of the table's header.
    """

    def __init__(self, max_depth: int = 1, header_style: str = "bold magenta", **summarize_kwargs: Any) -> None:
        require_rich("RichModelSummary")
        if summarize_kwargs:
            raise TypeError(
                f"RichModelSummary got unexpected keyword argument(s) {sorted(summarize_kwargs)}; it takes max_depth"
                " and header_style."
            )
        super().__init__(max_depth)
        self.header_style = header_style

    def _show(self, module: TrainingModule) -> None:
        # Lazy for import time and because rich is optional: only a summary being printed loads it.
        from rich import get_console
        from rich.table import Table

        console = get_console()
        rows = summary_rows(module, self.max_depth)
        if rows:
            table = Table(header_style=self.header_style)
            table.add_column(" ", style="dim")
            table.add_column(SUMMARY_HEADER[1], justify="left", no_wrap=True)
            table.add_column(SUMMARY_HEADER[2])
            table.add_column(SUMMARY_HEADER[3], justify="right")
            table.add_column(SUMMARY_HEADER[4])
            for row in rows:
                table.add_row(*row)
            console.print(table)
        grid = Table.grid(expand=True)
        grid.add_column()
        for value, label in summary_totals(module):
            grid.add_row(f"[bold]{label}[/]: {value}")
        console.print(grid)


__all__ = ["RichModelSummary", "require_rich"]
