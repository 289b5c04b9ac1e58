"""BlockTable: one rank's page tables as a device tensor, appended to step by step.

Every rank keeps the page tables of the requests it serves where its kernels read them: row ``i``
of ``table`` holds, for one running request, the physical page of each logical page on this rank
(-1 where another rank stores it). The rank's scheduler replica grows a request's page list one
page at a time (``KVPlacement.grow``); ``sync`` writes only the entries added since the last step,
so a step costs O(B + new pages), never O(history). A switch re-places every history and
``rewrite`` writes those rows anew once. Rows are recycled when requests finish.
"""
from __future__ import annotations

import torch

from splash_rollout.engine.request import Request


class BlockTable:
    def __init__(self, max_rows: int, device: torch.device, initial_pages: int = 64) -> None:
        self.table = torch.full((max_rows + 1, initial_pages), -1, dtype=torch.int64, device=device)
        """[max_rows + 1, max_pages] int64: physical page per (row, logical page), -1 where not here; the
        last row is never given to a request (``empty_row``)."""
        self.empty_row = max_rows
        """A row of -1 only: the table row of a padded request in a fixed-shape decode step."""
        self._row: dict[int, int] = {}
        """request_id -> its row."""
        self._synced: dict[int, int] = {}
        """request_id -> logical pages already written to its row."""
        self._free = list(range(max_rows - 1, -1, -1))

    @property
    def num_rows_in_use(self) -> int:
        return len(self._row)

    def rows(self, requests: list[Request], rank: int, width: int = 0) -> list[int]:
        """The rows of ``requests`` (host), after writing the pages each gained since the last step
        (one indexed write for the whole step); the table is at least ``width`` pages wide after."""
        rows, r_idx, c_idx, values = [], [], [], []
        widest = 0
        for req in requests:
            rid = req.request_id
            row = self._row.get(rid)
            if row is None:
                if not self._free:
                    raise RuntimeError(f"BlockTable: no free row for request {rid} "
                                       f"({self.table.shape[0]} rows, all in use)")
                row = self._row[rid] = self._free.pop()
                self._synced[rid] = 0
            pages = req.rank_pages[rank]
            have = self._synced[rid]
            if len(pages) > have:
                r_idx += [row] * (len(pages) - have)
                c_idx += range(have, len(pages))
                values += pages[have:]
                self._synced[rid] = len(pages)
            widest = max(widest, len(pages))
            rows.append(row)
        if max(widest, width) > self.table.shape[1]:
            self._widen(max(widest, width))
        if values:
            device = self.table.device
            self.table[torch.tensor(r_idx).to(device), torch.tensor(c_idx).to(device)] = \
                torch.tensor(values, dtype=torch.int64).to(device)
        return rows

    def slice(self, rows: list[int], pages: int) -> torch.Tensor:
        """[len(rows), pages] int64 on the table's device: those rows' first ``pages`` logical pages."""
        return self.table[torch.tensor(rows, dtype=torch.int64).to(self.table.device), :pages]

    def rewrite(self, requests: list[Request]) -> None:
        """After a switch re-placed these requests' pages: their rows are written again at the next ``rows``."""
        for req in requests:
            row = self._row.get(req.request_id)
            if row is not None:
                self.table[row].fill_(-1)
                self._synced[req.request_id] = 0

    def release(self, request_id: int) -> None:
        row = self._row.pop(request_id, None)
        if row is not None:
            self.table[row].fill_(-1)
            del self._synced[request_id]
            self._free.append(row)

    def _widen(self, pages: int) -> None:
        width = max(pages, 2 * self.table.shape[1])
        wider = torch.full((self.table.shape[0], width), -1, dtype=torch.int64, device=self.table.device)
        wider[:, : self.table.shape[1]] = self.table
        self.table = wider
