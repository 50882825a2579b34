"""Fixtures of the command-line tests: a tiny random-weight pair (fast to compile). Running a command as a
user does: tests/commands.py."""

import jax
import pytest

from specdec import models
from specdec.models.acceptance_head import HeadConfig, init_head
from specdec.training import acceptance, save_params
from tests.commands import VOCAB


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
  """Random tiny drafter (with an acceptance head) and verifier exports: (drafter dir, verifier dir)."""
  root = tmp_path_factory.mktemp("pair")
  drafter = models.build("tiny", vocab_size=VOCAB, seed=1, max_length=256)
  save_params(str(root / "drafter"), drafter, preset="tiny")
  acceptance.save_head(str(root / "drafter"), init_head(HeadConfig(drafter.config.embed_dim, depth=1),
                                                        jax.random.PRNGKey(0)))
  save_params(str(root / "verifier"), models.build("tiny", vocab_size=VOCAB, seed=2, max_length=256), preset="tiny")
  return str(root / "drafter"), str(root / "verifier")
