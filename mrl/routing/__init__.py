"""Keep Routing: routes codec (engine -> compact arrays); replay into megatron's RouterReplay comes next."""
