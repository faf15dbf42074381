"""Policy rules for tool calls and shell commands, and the audit trail (public path).

``CodeExecutor(policy=Policy(...))`` evaluates the rules in the tool server before anything
reaches the application's approval; ``ipybox --policy FILE`` reads them from a TOML file
(`load_policy`). See ``ipybox.app.approval._policy`` for how rules match.
"""

from ipybox.app.approval import Policy, Rule, Verdict, load_policy

__all__ = ["Policy", "Rule", "Verdict", "load_policy"]
