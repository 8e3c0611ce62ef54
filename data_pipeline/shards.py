"""Writing a data set's shards (create_pretraining_data, create_segments): each shard by a
pure function of (config, shard, tokenizer), in this process or in spawned worker processes
that each build their tokenizer once; the output directory is removed again when the run
fails, so a failed run leaves nothing behind."""

from __future__ import annotations

import contextlib
import multiprocessing
import shutil
from collections.abc import Callable, Sequence
from typing import Any

from etils import epath

from bertjax import paths

MakeShard = Callable[[Any, int, Any], dict]  # (config, shard, tokenizer) → the shard's counts


@contextlib.contextmanager
def output_directory(path: str, owned: bool = True, flag: str = "--output_dir"):
    """Creates `path` (given by `flag`) for a run's shards; when the run fails (a bad line
    deep in the corpus) and `path` is new and `owned` (no other task writes there), it is
    removed again with whatever was written."""
    created = owned and not paths.exists(path)
    paths.makedirs(path, flag)
    try:
        yield
    except BaseException:
        if created:
            if paths.is_remote(path):
                epath.Path(path).rmtree(missing_ok=True)
            else:
                shutil.rmtree(path, ignore_errors=True)
        raise


_worker_tokenizer = None  # one per worker process: its word cache stays warm across shards


def _init_worker(tokenizer_factory) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer_factory()


def _worker(args) -> tuple[int, dict]:
    make_shard, cfg, shard = args
    return shard, make_shard(cfg, shard, _worker_tokenizer)


def write_shards(make_shard: MakeShard, cfg, shards: Sequence[int], tokenizer,
                 tokenizer_factory: Callable[[], Any], num_workers: int) -> dict[int, dict]:
    """{shard: make_shard(cfg, shard, tokenizer)} for every shard: here with `tokenizer`, or
    in `num_workers` processes (make_shard, cfg and tokenizer_factory must be picklable)."""
    if num_workers == 1 or len(shards) == 1:
        return {s: make_shard(cfg, s, tokenizer) for s in shards}
    # spawn, not fork: the parent may have imported TensorFlow (whose threads do not survive
    # a fork); the workers themselves never import it.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(num_workers, len(shards)), _init_worker, (tokenizer_factory,)) as pool:
        return dict(pool.imap_unordered(_worker, [(make_shard, cfg, s) for s in shards]))
