// Package deadletter lists, replays and deletes the dead letters waiting in a dead-letter topic:
// the messages the router gave up, each with the headers that say why, where and when
// (messagedata.DeadLetterHeaders). It is the one implementation behind `onceflow dlq` and the
// console's dead-letter pages.
//
// A Queue reads the dead letters that wait for one consumer group of a broker, oldest first,
// without consuming them (broker.Broker.Peek). List filters them by handler, topic, reason and
// time, and pages through them; Get returns one in full. Replay puts chosen ones back on the
// topic they came from, with their original id, so that the handler's duplicate detection
// recognises a message that was applied already; Delete removes chosen ones for good. Both go
// on past a dead letter that fails and report each one's fate: a dead letter the broker cannot
// take back (an id or a header it cannot carry) holds up none of the others.
package deadletter
