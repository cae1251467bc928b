"""The library needs torch only; the command's and the pictures' libraries are extras that say so."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from plait.app.cli import CLI_EXTRAS


def test_library_imports_with_torch_alone_and_the_command_names_its_extra(tmp_path):
    """... and `plait --version` and `plait --help` answer without importing torch (a user's
    first command: torch's import alone takes seconds)."""
    # One process with every optional library made unimportable (None in sys.modules).
    blocked = [*CLI_EXTRAS, "matplotlib", "transformers"]
    code = textwrap.dedent(f"""
        import contextlib, io, sys
        for name in {blocked!r}:
            sys.modules[name] = None
        from plait.app.cli import main
        with contextlib.redirect_stdout(io.StringIO()) as said:  # `plait --version`, `plait --help`
            assert main(["--version"]) == 0 and main(["--help"]) == 0
        assert said.getvalue().startswith("plait 0.1.0\\nusage: plait"), said.getvalue()
        assert "torch" not in sys.modules, "plait --help imported torch"
        import plait, plait.check, plait.cp, plait.ddp, plait.ep, plait.fsdp, plait.tp, plait.state.checkpoint
        from plait.pipeline import draw
        from plait.pipeline.generators import one_f_one_b
        print(draw.render_text(one_f_one_b(2, 2)).splitlines()[0])
        try:
            draw.draw_png(one_f_one_b(2, 2), {str(tmp_path / "s.png")!r})
        except ModuleNotFoundError as e:
            print("draw:", e)
        from plait.app.cli import main
        sys.exit(main(["train", "--steps", "1"]))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stdout.startswith("1f1b: 2 ranks"), res.stdout  # text pictures need no extra
    assert "draw: plait.pipeline.draw.draw_png needs matplotlib" in res.stdout and "plait[viz]" in res.stdout
    assert "pip install 'plait[cli]'" in res.stderr, res.stderr
