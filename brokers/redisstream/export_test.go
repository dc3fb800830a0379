package redisstream

// ReleasedConsumerForTest is the consumer name Close hands unacked entries
// to.
const ReleasedConsumerForTest = releasedConsumer
