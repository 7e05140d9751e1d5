"""The names the plugin's modules share (no imports: every module of the plugin may use them)."""

# The architecture name a saved highrank folder's config.json gives.
ARCHITECTURE = "HighrankForCausalLM"
MODEL_CLASS = "highrank.integrations.vllm.model:HighrankForCausalLM"
# What every refusal names: the fix.
PLUGIN = "highrank's vLLM plugin (pip install 'highrank[vllm]' in vLLM's environment)"
