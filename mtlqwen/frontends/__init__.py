"""User-facing front-ends over the engine: `mtlqwen chat` (terminal chat) and `mtlqwen serve`
(OpenAI-compatible HTTP server). Each module registers its subcommand with mtlqwen.cli."""
