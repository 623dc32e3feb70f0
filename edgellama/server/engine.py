"""The engine: the one thread that runs the model, its slots and the queue in front of
them: Engine (continuous batching, prefix reuse, slot files and spilling, speculative
decoding) and Slot. Requests arrive already checked (params.py) as Jobs (job.py), and
leave as the Job's events, which app.py turns into HTTP; nothing here parses a request
or writes a response.

Prefix reuse: a slot keeps its cache after a request, and a new request goes to the free
slot whose cache its prompt continues (else the least recently used), which recomputes
only from the first token that differs; so a client that re-sends its conversation pays
only for what is new, even while other conversations come and go. `usage.prompt_tokens_details.
cached_tokens` says how much was reused.

Slot files (create_app(slot_save_path=DIR), `serve --slot-save-path`): llama.cpp's POST
/slots/{id}?action=save|restore|erase writes a slot's cache to DIR/filename or reads one
back (prompt_cache's format, names checked by slot_files.SlotFiles), on the engine thread
between steps (Engine.run); and an evicted conversation's cache is spilled to DIR and
restored when the conversation comes back (Engine._prepare). The folder failing under
the running server (removed, replaced by a file, unwritable, full) is the server's
storage, not the client's request: a save answers 507, a restore 503, logged once.

Speculative decoding (create_app(drafter=...), `serve --draft/--lookup`): a slot may
check proposed tokens in the engine's step, where speculative.plan_step says they raise
the step's expected tokens per second (Engine); usage then counts them in OpenAI's
completion_tokens_details.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .. import prompt_cache
from ..errors import EdgeError
from ..generation import step
from ..llm import LLM
from ..machine import available_memory
from ..scratch import Scratch
from ..sequence import Sequence
from ..slot_files import SPILL_MIN, BadFileName, NoSuchFile, SlotFiles, StorageError
from ..speculative import DraftLength, DraftModel, Drafter, PassCost
from .job import Job
from .metrics import EngineCounters
from .params import ApiError, _bad

log = logging.getLogger("edgellama.server")

DEFAULT_QUEUE = 16
DEFAULT_PARALLEL = 4        # slots unless --parallel says (fewer if memory is short): the
                            # batched decode kernels multiply tokens in groups of four, so
                            # up to four sequences share one pass's work (bench_batch_decode)
PREFILL_CHUNK = 64          # prompt tokens read per step while other requests decode: a
                            # decode step costs what a few prompt tokens do, so a long prompt
                            # is read nearly as fast as alone, and the others stall one chunk


@dataclass(eq=False)
class Slot:
    """One sequence of the engine. Its KV cache outlives the requests it serves: the next
    request that shares a prefix with the tokens it holds reads only the rest."""
    index: int
    seq: Sequence
    job: Job | None = None
    last_used: int = 0    # admission count when it last took a job
    drafter: Drafter | None = None       # speculative decoding: its own (a draft model's
    length: DraftLength | None = None    # KV cache), with its acceptance measured


def shared_prefix(cached: list[int], ids: list[int]) -> int:
    """How many leading tokens `cached` and `ids` have in common."""
    n = 0
    for a, b in zip(cached, ids):
        if a != b:
            break
        n += 1
    return n


def _reusable(cached: list[int], ids: list[int]) -> int:
    """The tokens a prompt would reuse of a slot's cache, counted only where the prompt
    continues what the slot holds (keeps at least half of it): a chat template's opening
    alone saves little, and taking that slot would evict another conversation."""
    n = shared_prefix(cached, ids)
    return n if 2 * n >= len(cached) else 0


def choose_parallel(asked: int | None, slot_bytes: int, ctx: int) -> int:
    """The number of slots: `asked`, refused if the available memory cannot hold that many
    full KV caches; by default DEFAULT_PARALLEL, fewer if memory holds fewer (at least
    one: loading the model checked that one fits). A cache's pages are mapped as its
    positions are written, so this is the most the slots can come to take, never an
    out-of-memory kill halfway through a reply."""
    avail = available_memory()
    fits = None if avail is None else avail // slot_bytes
    if asked is None:
        return DEFAULT_PARALLEL if fits is None else max(1, min(DEFAULT_PARALLEL, fits))
    if asked < 1:
        raise EdgeError(f"--parallel must be at least 1, got {asked}")
    if fits is not None and asked > fits:
        raise EdgeError(f"--parallel {asked} needs {asked * slot_bytes / 2**20:.0f} MiB of KV "
                        f"cache ({slot_bytes / 2**20:.0f} MiB a slot at ctx {ctx}), but only "
                        f"{avail / 2**20:.0f} MiB of memory is available; use a smaller "
                        f"--parallel or --ctx")
    return asked


class Engine:
    """The one thread that runs the model, its `parallel` slots and the bounded queue in
    front of them.

    Continuous batching: each step reads one chunk of the prompt of the earliest admitted
    request still reading (PREFILL_CHUNK tokens while others decode, so they are not
    stalled long; the model's batch when none does), then decodes one token for every
    request whose prompt is read, all of them in one pass over the weights
    (Transformer.decode). Requests join (a free slot) and leave (done, cancelled) between
    steps, so none waits for another to finish, and each decoding request gets one token
    a step. A request goes to the free slot whose cache its prompt continues furthest
    (_reusable), else to the least recently used one, so interleaved conversations keep
    their caches. All slots share one Scratch: one pass runs at a time.

    Speculative decoding (`drafter`: a draft model or prompt lookup, one copy a slot): in
    a step, a slot may also feed proposed tokens, checked in the same pass as the other
    slots' tokens (Transformer.decode's counts); plan_step picks, from the measured pass
    costs and each slot's acceptance, the proposals that raise the step's expected tokens
    per second, so with several slots decoding only a high acceptance drafts. A slot
    that is not drafting probes every probe_interval steps: one proposal, compared with the
    token its plain step chooses (what its check would accept at temperature 0), which
    adds no row to the pass."""

    def __init__(self, llm: LLM, capacity: int = DEFAULT_QUEUE, parallel: int | None = None,
                 drafter: Drafter | None = None, files: SlotFiles | None = None):
        self.llm, self.capacity, self.files = llm, capacity, files
        model = llm.model
        self.scratch = Scratch()
        first = model.new_sequence(scratch=self.scratch)
        draft_bytes = drafter.seq.cache.nbytes if isinstance(drafter, DraftModel) else 0
        self.parallel = choose_parallel(parallel, first.cache.nbytes + draft_bytes, llm.ctx)
        self.slots = [Slot(0, first)] + [Slot(i, model.new_sequence(scratch=self.scratch))
                                         for i in range(1, self.parallel)]
        self.costs = PassCost(model.one_pass_verify) if drafter else None
        if drafter:
            for slot in self.slots:
                slot.drafter = drafter if slot.index == 0 else drafter.copy()
                slot.length = DraftLength(*drafter.bounded(llm.ctx), costs=self.costs)
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []     # in admission order
        self._calls: list[tuple[Future, Callable]] = []   # run() between steps
        self._admitted = 0
        self._closed = False
        self._storage_problem: str | None = None   # the slot files' failure last logged
        self.counters = EngineCounters()           # GET /metrics
        self._thread = threading.Thread(target=self._work, name="edgellama-engine", daemon=True)
        self._thread.start()

    @property
    def kv_cache_bytes(self) -> int:
        """The slots' KV caches at full context: the most they take."""
        return sum(s.seq.cache.nbytes for s in self.slots)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            # a job that finds a free slot waits only until the engine thread takes it
            free = self.parallel - len(self._active)
            if len(self._waiting) >= self.capacity + free:
                raise ApiError(503, f"the server is busy: {len(self._active)} requests are "
                                    f"running (--parallel {self.parallel}) and "
                                    f"{len(self._waiting)} are waiting, the most it queues "
                                    f"(--queue {self.capacity}); retry later", code="queue_full")
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop a job: dropped if still waiting, else stopped before its next step."""
        job.cancelled.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                job.emit("cancelled")

    def status(self) -> dict:
        with self._cond:
            return {"running": len(self._active), "waiting": len(self._waiting),
                    "capacity": self.capacity}

    def slot_status(self) -> dict:
        """The slots for /health: how many, which are busy, the tokens each cache holds,
        and their KV cache memory."""
        with self._cond:
            return {"parallel": self.parallel,
                    "busy": sum(s.job is not None for s in self.slots),
                    "cached_tokens": [len(s.seq.tokens) for s in self.slots],
                    "kv_cache_bytes_per_slot": self.slots[0].seq.cache.nbytes,
                    "kv_cache_bytes": self.kv_cache_bytes}

    def slot_list(self) -> list[dict]:
        """GET /slots (llama.cpp's names): each slot's id, whether it is busy, its
        context and the tokens its cache holds."""
        with self._cond:
            return [{"id": s.index, "is_processing": s.job is not None, "n_ctx": s.seq.ctx,
                     "n_cached": s.seq.pos} for s in self.slots]

    def shutdown(self) -> None:
        """Take no more requests, and end the waiting and running ones now: each is told
        503 shutting_down (the running ones stop before the next step). Returns at once;
        safe to call more than once, from any thread."""
        with self._cond:
            self._closed = True
            jobs = list(self._waiting) + self._active
            self._waiting.clear()
            calls, self._calls = self._calls, []
            self._cond.notify_all()
        for future, _ in calls:
            if future.set_running_or_notify_cancel():   # not cancelled: its client waits
                future.set_exception(ApiError(503, "the server is shutting down",
                                              code="shutting_down"))
        for job in jobs:
            job.cancelled.set()
            job.emit("error", ApiError(503, "the server is shutting down; the request was "
                                            "not finished", code="shutting_down"))

    def close(self, timeout: float = 5.0) -> None:
        """shutdown(), then wait (at most `timeout` s) for the engine thread to end."""
        self.shutdown()
        self._thread.join(timeout)

    def run(self, fn: Callable[[], Any]) -> Future:
        """fn() on the engine thread between steps (where no pass uses a slot's cache and
        no request is admitted), its result or exception in the future."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            self._calls.append((future, fn))
            self._cond.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._active or self._calls or self._closed):
                    self._cond.wait()
                if self._closed:
                    return
                calls, self._calls = self._calls, []
            for future, fn in calls:   # outside the lock: file work must not block submit()
                if not future.set_running_or_notify_cancel():   # its client left
                    continue
                try:
                    future.set_result(fn())
                except Exception as e:  # noqa: BLE001 - that request fails, the server stays up
                    if not isinstance(e, ApiError):
                        log.exception("a slot action failed")
                        e = ApiError(500, "internal error; the server log has the details")
                    future.set_exception(e)
            with self._cond:
                admitted = self._admit()
                jobs = list(self._active)
            for job in admitted:
                self._prepare(job)
            for job in jobs:
                if job.cancelled.is_set():   # the client left: its slot is free now
                    self._release(job, "cancelled")
            jobs = [j for j in jobs if not j.cancelled.is_set()]
            reading = [j for j in jobs if j.reading]
            ready = [j for j in jobs if not j.reading]
            if reading:
                self._guarded(reading[:1], self._read_prompt, reading[0], bool(ready))
            if ready:
                self._guarded(ready, self._decode, ready)

    def _admit(self) -> list[Job]:
        """Waiting jobs into free slots, first come first served (holding the lock); the
        jobs admitted, for _prepare."""
        free = [s for s in self.slots if s.job is None]
        admitted = []
        while self._waiting and free:
            job = self._waiting.popleft()
            slot = max(free, key=lambda s: (_reusable(s.seq.tokens, job.ids), -s.last_used))
            free.remove(slot)
            self._admitted += 1
            slot.job, slot.last_used = job, self._admitted
            job.start(slot, self.llm.tokenizer)
            self._active.append(job)
            admitted.append(job)
        return admitted

    def _prepare(self, job: Job) -> None:
        """The job's slot cut to what its prompt reuses. With --slot-save-path, a
        conversation of at least SPILL_MIN tokens that the job evicts is spilled to a file
        first, and a spilled one the prompt continues further than the slot's cache is
        restored into the slot (SlotFiles). A failed spill or restore costs only time: it
        is logged, and the prompt is read."""
        seq, files = job.slot.seq, self.files
        if files is not None and files.spill_max > 0:
            keep = _reusable(seq.tokens, job.ids)
            spilled = files.best(job.ids)
            restore = spilled is not None and spilled[1] > keep
            if (restore or not keep) and seq.pos >= SPILL_MIN:
                try:
                    files.spill(seq, self.llm.model)
                except EdgeError as e:
                    self._log_storage(f"a conversation was not spilled: {e}")
            if restore:
                try:
                    files.restore(spilled[0], seq, self.llm.model)
                except EdgeError as e:
                    log.warning("slot %d: spilled cache not restored: %s", job.slot.index, e)
        job.reused = seq.reuse_prefix(job.ids)
        job.t_admitted = time.perf_counter()

    # -- POST /slots/{id}: on the engine thread (run()), so no request is admitted to the
    # slot, and no pass reads its cache, while its file is written or read
    def _idle_slot(self, index: int) -> Slot:
        slot = self.slots[index]
        if slot.job is not None:
            raise ApiError(409, f"slot {index} is busy with a request; retry when it is done",
                           code="slot_busy")
        return slot

    def save_slot(self, index: int, filename: Any) -> dict:
        slot = self._idle_slot(index)
        path = self._slot_file(filename, saving=True)
        n = slot.seq.pos
        if n == 0:
            raise _bad(f"slot {index} holds no cache to save", code="slot_empty")
        t0 = time.perf_counter()
        try:
            prompt_cache.save(path, slot.seq, self.llm.model)
            written = path.stat().st_size
        except (EdgeError, OSError) as e:
            raise self._file_failed(e, path, filename, saving=True) from None
        self._storage_problem = None
        return {"id_slot": index, "filename": filename, "n_saved": n, "n_written": written,
                "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}

    def restore_slot(self, index: int, filename: Any) -> dict:
        slot = self._idle_slot(index)
        path = self._slot_file(filename, saving=False)
        t0 = time.perf_counter()
        try:
            read = path.stat().st_size
            prompt_cache.load(path, slot.seq, self.llm.model)
        except (EdgeError, OSError) as e:
            raise self._file_failed(e, path, filename, saving=False) from None
        self._storage_problem = None
        return {"id_slot": index, "filename": filename, "n_restored": slot.seq.pos,
                "n_read": read, "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}

    def _slot_file(self, filename: Any, saving: bool):
        try:
            return self.files.path(filename, saving)
        except NoSuchFile as e:
            raise ApiError(404, str(e), "filename", "file_not_found") from None
        except BadFileName as e:
            raise _bad(str(e), "filename", "invalid_filename") from None
        except StorageError as e:
            raise self._storage_failed(e, filename, saving) from None

    def _file_failed(self, e: Exception, path, filename: str, saving: bool) -> ApiError:
        """What a failed save or restore answers. The server's storage failing (the
        folder gone or replaced, unwritable, a full disk, a read error) is not the
        client's doing: 507 for a save (RFC 4918: the server cannot store what the
        request needs), 503 for a restore. A file that is not a usable saved prompt
        (damaged, another model's) is the client's: 400."""
        cause = e if isinstance(e, OSError) else e.__context__
        if isinstance(cause, FileNotFoundError) and not saving:
            return ApiError(404, _local(e, path, filename), "filename", "file_not_found")
        try:
            self.files.check(writing=saving)
        except StorageError as broken:
            return self._storage_failed(broken, filename, saving)
        if isinstance(cause, OSError):
            return self._storage_failed(e, filename, saving, path)
        return _bad(_local(e, path, filename), "filename",
                    "save_failed" if saving else "restore_failed")

    def _log_storage(self, detail: str) -> None:
        """One line for a failure of the slot files' storage, the first time (not again
        until a save or restore succeeds, or another problem comes)."""
        if detail != self._storage_problem:
            self._storage_problem = detail
            log.error("slot files: %s", detail)

    def _storage_failed(self, e: Exception, filename: str, saving: bool,
                        path=None) -> ApiError:
        """The answer to a save or restore that the server's storage failed."""
        self._log_storage(str(e) if isinstance(e, EdgeError) else f"{path}: {e.strerror or e}")
        where = _local(e, path, filename).replace(str(self.files.folder), "the slot folder")
        action = "save to" if saving else "restore from"
        return ApiError(507 if saving else 503, f"cannot {action} {filename}: the server's "
                        f"storage failed: {where}", "filename", "storage_failed")

    def erase_slot(self, index: int) -> dict:
        slot = self._idle_slot(index)
        n = slot.seq.pos
        slot.seq.reset()
        return {"id_slot": index, "n_erased": n}

    def _guarded(self, jobs: list[Job], step, *args) -> None:
        """Run one step for `jobs`; if it fails, they fail (500) and the server goes on."""
        try:
            step(*args)
        except Exception as e:  # noqa: BLE001 - those requests fail, the server stays up
            if isinstance(e, EdgeError):   # the model, not the request (that was checked)
                error = ApiError(500, str(e))
            else:
                log.exception("generation failed")
                error = ApiError(500, "internal error while generating; the server log "
                                      "has the details")
            for job in jobs:
                job.emit("error", error)
                self._release(job, None)

    def _read_prompt(self, job: Job, others_decoding: bool) -> None:
        """One chunk of the job's prompt into its slot's cache. A client that leaves
        stops the reading between chunks; what was read stays for the next request."""
        seq = job.slot.seq
        chunk = PREFILL_CHUNK if others_decoding else self.llm.model.batch
        end = min(len(job.ids) - 1, seq.pos + chunk)
        self.counters.on_pass(len(self._active))
        self.llm.model.forward(job.ids[seq.pos:end], seq)

    def _decode(self, jobs: list[Job]) -> None:
        """One token for each job, all in one pass over the weights (generation.step);
        with a drafter, a job may also check proposals in that pass, and take each one
        accepted. Their text is sent as it comes; a finished job is done."""
        t0 = time.perf_counter()
        for job in jobs:
            if job.t_generating is None:   # its prompt is read: this step feeds its last token
                self.counters.on_prompt(job, t0)
        self.counters.on_pass(len(self._active))
        step([j.gen for j in jobs], self.llm.model, self.scratch, self.costs)
        for job in jobs:
            g = job.gen
            if g.error is not None:   # its grammar gave up mid-reply: this request
                # fails, not the others of the step
                job.emit("error", ApiError(400, str(g.error), job.params.grammar_param,
                                           "invalid_grammar"))
                self._release(job, None)
            elif g.finish_reason is not None:
                self._finish(job)

    def _finish(self, job: Job) -> None:
        g = job.gen
        if g.tail is not None:   # text held back by the decoder (a partial character) or
            rest = job.take_logprobs(g.count, self.llm.tokenizer)   # the stop matcher
            if g.tail or rest:
                job.emit("text", g.tail, rest)
        prompt = len(job.ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": job.count,
                 "total_tokens": prompt + job.count,
                 "prompt_tokens_details": {"cached_tokens": job.reused}}
        if self.costs:   # speculative decoding: proposals kept and not (OpenAI's names)
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": job.accepted,
                "rejected_prediction_tokens": job.drafted - job.accepted}
        self._release(job, None)   # first: a client that has its reply finds the slot free
        job.emit("done", g.finish_reason, usage)

    def _release(self, job: Job, event: str | None) -> None:
        """Free the job's slot (its cache stays, for prefix reuse); tell the client `event`."""
        if event:
            job.emit(event)
        with self._cond:
            if job in self._active:
                self._active.remove(job)
                job.slot.job = None
                self.counters.on_release(job, job.slot.seq.pos, time.perf_counter())


def _local(e: Exception, path, filename: str) -> str:
    """An error about a slot file, naming it as the client did (not the server's folder)."""
    text = str(e) if isinstance(e, EdgeError) else f"{path}: {e.strerror or e}"
    return text if path is None else text.replace(str(path), filename)
