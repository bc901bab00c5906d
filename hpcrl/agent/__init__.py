"""Agentic RL over HTTP (``rollout.agent``; ``docs/agents.md``): an OpenAI-compatible gateway in the controller
(:mod:`hpcrl.agent.gateway`) records every call of every agent session token-exact (:mod:`hpcrl.agent.session`);
:mod:`hpcrl.agent.runner` runs the agents (a Python function or any command) and turns episodes into samples;
:mod:`hpcrl.agent.tools` parses Hermes-style tool calls."""
