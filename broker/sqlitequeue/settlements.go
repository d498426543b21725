package sqlitequeue

import (
	"sync"
	"time"
)

// settlements holds the settlements that the subscriptions of one topic in a Queue have given
// and that are not committed yet. The next transaction of any of them commits all, its own
// and the others': every transaction of the queue file takes its write lock and writes its
// WAL, and a router's subscriptions of one topic (Handler.Concurrency of them) then share them.
type settlements struct {
	mu    sync.Mutex
	ended sync.Cond // signalled when a transaction with settlements taken ends
	list  []settlement
	since time.Time // when the oldest of list was added
	taken int       // transactions in progress with settlements taken from list
	// owed counts, per subscription, the settlements it gave that are not committed.
	owed map[*subscription]int
}

func newSettlements() *settlements {
	p := &settlements{owed: map[*subscription]int{}}
	p.ended.L = &p.mu
	return p
}

// settlements returns the settlements of topic's subscriptions.
func (q *Queue) settlements(topic string) *settlements {
	if p, ok := q.pools.Load(topic); ok {
		return p.(*settlements)
	}
	p, _ := q.pools.LoadOrStore(topic, newSettlements())
	return p.(*settlements)
}

// add adds a settlement, given at now, to commit.
func (p *settlements) add(s settlement, now time.Time) {
	p.mu.Lock()
	if len(p.list) == 0 {
		p.since = now
	}
	p.list = append(p.list, s)
	p.owed[s.from]++
	p.mu.Unlock()
}

// len returns how many settlements wait, those taken by transactions in progress left out.
func (p *settlements) len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.list)
}

// due returns when the settlements waiting are to be committed: settleWait after the oldest
// was given; false when none waits.
func (p *settlements) due() (time.Time, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.list) == 0 {
		return time.Time{}, false
	}
	return p.since.Add(settleWait), true
}

// take takes every settlement waiting, for a transaction that must then call done.
func (p *settlements) take() []settlement {
	p.mu.Lock()
	defer p.mu.Unlock()
	list := p.list
	p.list = nil
	p.taken++
	return list
}

// done ends a transaction that took list: when it failed, the settlements wait again, for the
// next transaction.
func (p *settlements) done(list []settlement, failed bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case failed && len(list) > 0:
		if len(p.list) == 0 {
			p.since = time.Now()
		}
		p.list = append(list, p.list...)
	case !failed:
		for _, s := range list {
			if p.owed[s.from]--; p.owed[s.from] == 0 {
				delete(p.owed, s.from)
			}
		}
	}
	p.taken--
	p.ended.Broadcast()
}

// wait returns how many of the settlements that from gave are not committed, once no
// transaction in progress holds any of them: 0, or those that wait for the next transaction.
func (p *settlements) wait(from *subscription) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.owed[from] > 0 && p.taken > 0 {
		p.ended.Wait()
	}
	return p.owed[from]
}
