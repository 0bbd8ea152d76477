-- Returns the stored and reserved page counts.
return {redis.call('HLEN', map), redis.call('HLEN', resv)}
