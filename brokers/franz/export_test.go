package franz

// DefaultMaxInFlight is Config.MaxInFlight's default.
const DefaultMaxInFlight = defaultMaxInFlight
