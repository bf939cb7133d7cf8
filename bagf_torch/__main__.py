"""``python -m bagf_torch``: see ``bagf_torch.cli`` (``cli.run``: the command's status by ``os._exit``)."""

from .cli import main, run  # noqa: F401  (main: what callers in a process of their own use)

if __name__ == "__main__":
    run()
