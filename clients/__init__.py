"""Programs that talk to the chat server over HTTP only: chat, the MT-Bench demo, load benchmarks."""
