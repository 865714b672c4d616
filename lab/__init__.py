"""mlxchat lab: tune sampling on fixed prompt sets (prompts x settings x seeds), with metrics, stored runs,
regression bounds, reports and blind A/B votes. A tool above core (like bench); see docs/lab.md."""
