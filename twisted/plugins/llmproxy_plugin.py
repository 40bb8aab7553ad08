# A lazy dropin: `twistd --help` lists llmproxy without importing the application.
from twisted.application.service import ServiceMaker

llmproxy = ServiceMaker(
    "llmproxy", "llmproxy.tap", "One OpenAI-compatible URL for a LAN's GPU hosts.", "llmproxy"
)
