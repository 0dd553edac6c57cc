"""The console below its screen: one SSH link per node, the state store, pre-flight, cluster sets."""
