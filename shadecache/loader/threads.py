"""The assembly threads of a CachedLoader (num_workers of them, in the training process)."""
import queue
import threading

THREAD_PREFIX = "shadecache-loader"   # thread names: shadecache-loader-<k>
_STOP = None  # the job that tells an assembly thread to end


class AssemblyThreads:
    """num_workers assembly threads. Batch k goes to thread k % W, and each thread makes its
    batches in the order given, so batch k is the next result of thread k % W: results come back
    in order with no per-batch bookkeeping. The threads hold the make function and their two
    queues, never the iterator, so dropping the iterator runs its `finally` and stops them."""

    def __init__(self, make, workers: int):
        self._jobs = [queue.SimpleQueue() for _ in range(workers)]
        self._results = [queue.SimpleQueue() for _ in range(workers)]
        self._threads = []
        for w in range(workers):
            t = threading.Thread(target=_assemble_loop, args=(make, self._jobs[w], self._results[w]),
                                 name=f"{THREAD_PREFIX}-{w}", daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, k: int, ids) -> None:
        self._jobs[k % len(self._jobs)].put(ids)

    def take(self, k: int):
        """(True, batch) or (False, the exception that making batch k raised)."""
        return self._results[k % len(self._results)].get()

    def stop(self) -> None:
        """Ends every thread after the batch it is making (batches not taken are dropped)."""
        for q in self._jobs:
            try:
                while True:        # queued batches are not made
                    q.get_nowait()
            except queue.Empty:
                pass
            q.put(_STOP)
        for t in self._threads:
            t.join()


def _assemble_loop(make, jobs, results):
    while True:
        ids = jobs.get()
        if ids is _STOP:
            return
        try:
            results.put((True, make(ids)))
        except BaseException as exc:   # re-raised by the iterating thread when the batch is due
            results.put((False, exc))
