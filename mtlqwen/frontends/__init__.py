"""User-facing front-ends over the engine: `mtlqwen generate` (one completion), `mtlqwen chat`
(terminal chat) and `mtlqwen serve` (OpenAI-compatible HTTP server). Each module registers its
subcommand with mtlqwen.cli; the flags they share are in args.py, terminal output in terminal.py."""
