"""The engine's prefix-cache controls: the cache itself (read-only), clearing it, and prompt cache files
(prompt_file.py): a prompt's computed state saved, or loaded as an entry; and a prompt-logprob pass's state
adopted as one (logprobs.prompt_logprobs). A mixin of Engine, over its KV manager (the one owner of the entries).
"""

from __future__ import annotations

from . import prompt_file
from .admission import prompt_ids
from .sampling import SamplingParams


class PrefixControls:
    @property
    def prefix(self):
        """The KV manager's prefix cache, None when off (read-only view)."""
        return self.kv.prefix

    # ---- prompt cache files (prompt_file.py)
    def save_prompt_cache(self, path, prompt, request: dict | None = None) -> prompt_file.SavedPrompt:
        """Prefill `prompt` (token ids, or text for the tokenizer) unless the prefix cache holds it, and write its
        computed state to `path` (.safetensors appended if missing) for load_prompt_cache, in this process or
        another with the same model. request: what a frontend needs to extend the prompt, stored as JSON."""
        ids = prompt_ids(prompt, self.tokenizer)
        self._prompt_files()
        if self.prefix is None or self.prefix.exact(ids) is None:
            out = self.generate(ids, SamplingParams(max_tokens=1, temperature=0.0))[0]
            if out.finish_reason == "error":
                raise RuntimeError(f"the prompt's prefill failed: {out.error}")
        return prompt_file.save(self.kv, self.cache, path, ids, *self._made_by(), request)

    def load_prompt_cache(self, path) -> tuple[prompt_file.SavedPrompt, bool]:
        """Put a saved prompt into the prefix cache: (its header, whether a new entry was made; False when the
        prompt is cached already or larger than the cache's budget). ValueError for a file of another model."""
        self._prompt_files()
        return prompt_file.load(self.kv, self.cache, path, self._made_by()[0])

    def save_prefix_cache(self, folder) -> list[str]:
        """Every prefix-cache entry no other extends (the ends of conversations and prompts), a prompt cache file
        each, into `folder` (its older files replaced): what load_prefix_cache restores in another process with
        the same model. Returns the files written."""
        self._prompt_files()
        return prompt_file.save_dir(self.kv, self.cache, folder, *self._made_by())

    def load_prefix_cache(self, folder) -> tuple[int, list[str]]:
        """save_prefix_cache's files as prefix-cache entries (a conversation's turns share their common blocks):
        (entries made, why each skipped file was skipped)."""
        self._prompt_files()
        return prompt_file.load_dir(self.kv, self.cache, folder, self._made_by()[0])

    def _adopt_prompt(self, tokens: list[int], prefix) -> None:
        """A prompt-logprob pass's state as a prefix entry (no drafter: the pass writes no drafter rows). Only a
        saving: a pool too full for it is left alone."""
        try:
            self.kv.adopt(tokens, *prefix, self.cache)
        except ValueError:
            pass

    def _made_by(self) -> tuple[dict, str | None, str | None]:
        """(the identity a file's state depends on, the model's and the drafter's sources) of this engine."""
        drafter = self.spec.drafter if self.spec is not None else None
        return (prompt_file.identity(self.model, drafter), getattr(self.model, "source", None),
                getattr(drafter, "source", None))

    def _prompt_files(self) -> None:
        if getattr(self.model, "group", None) is not None:  # each rank holds a shard of every pool
            raise ValueError("prompt cache files are not written or read under tensor parallelism")
        if self.prefix is None:
            raise ValueError("prompt cache files need the prefix cache (prefix_interval > 0)")

    def clear_prefix_cache(self) -> int:
        """Drop every prefix-cache entry (their bundles return to the pool); returns how many."""
        return self.kv.clear()

