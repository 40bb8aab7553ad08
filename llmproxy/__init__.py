"""llmproxy: one OpenAI-compatible URL in front of a LAN's GPU hosts."""

__version__ = "0.1.0"
