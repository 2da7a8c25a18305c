"""``python -m llmgw``: the same program as the ``llmgw`` console script, for processes llmgw starts itself."""

from llmgw.cli.main import main

if __name__ == "__main__":
    main()
