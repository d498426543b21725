// Package redis is onceflow's code for Redis Streams that does not depend on package broker.
// Marshaller is the stream entry format of watermill-redisstream (the UUID in
// "_watermill_message_uuid", msgpack metadata in "metadata", the payload in "payload"), with an
// Unmarshal that never fails, so that an entry of another producer is delivered instead of
// ending a subscription.
package redis
